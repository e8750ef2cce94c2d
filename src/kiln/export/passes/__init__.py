"""Graph passes over kiln methods, one module each, run in the order of PIPELINE.

Each pass rewrites a method in place and returns how many rewrites it made; none changes what the method
computes. `run_passes` records, per pass, that count and the live node count after it (dead code is dropped
between passes so the counts mean something); the export stores these statistics in the program's metadata
(`kiln.passes`), where `kiln inspect --passes` and `kiln export -v` show them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.canonicalize_linear import canonicalize_linear
from kiln.export.passes.cse import eliminate_common_subexpressions
from kiln.export.passes.dce import eliminate_dead_code
from kiln.export.passes.fold_batch_norm import fold_batch_norm
from kiln.export.passes.fold_constants import fold_constants
from kiln.export.passes.fuse_attention import absorb_repeat_kv
from kiln.export.passes.fuse_combine import fuse_combine
from kiln.export.passes.fuse_conv import fuse_conv
from kiln.export.passes.fuse_experts import fuse_experts
from kiln.export.passes.fuse_gated_mlp import fuse_gated_mlp
from kiln.export.passes.fuse_linear import fuse_gated_linear, fuse_norm_linear
from kiln.export.passes.fuse_norm import fuse_rms_norm
from kiln.export.passes.fuse_projections import fuse_projections
from kiln.export.passes.fuse_qk_norm import fuse_qk_norm
from kiln.export.passes.fuse_residual_norm import fuse_residual_norm
from kiln.export.passes.fuse_rope import fuse_rope
from kiln.export.passes.fuse_rope_cache import fuse_rope_cache_update
from kiln.export.passes.fuse_router import fuse_router, fuse_router_norm
from kiln.export.passes.in_place import mark_in_place_state_writes
from kiln.export.passes.simplify import collapse_chains, remove_noops
from kiln.ir.graph import Method

if TYPE_CHECKING:
    from kiln.export.quantize import KnownQuantization, Quantize


@dataclass(frozen=True)
class PassOptions:
    """What the user asked of the export that passes act on: quantization, and weights whose quantized form is
    known already (a GGUF file's), kept as they are."""

    quantize: Quantize | None = None
    known_quantization: KnownQuantization | None = None


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Method, ProgramBuilder, PassOptions], int]
    doc: str


def _method_only(fn: Callable[[Method], int | dict]) -> Callable[[Method, ProgramBuilder, PassOptions], int]:
    def run(method: Method, builder: ProgramBuilder, options: PassOptions) -> int:
        result = fn(method)
        return sum(result.values()) if isinstance(result, dict) else result
    return run


def _with_builder(fn: Callable[[Method, ProgramBuilder], int]) -> Callable[[Method, ProgramBuilder, PassOptions], int]:
    return lambda method, builder, options: fn(method, builder)


def _quantize(method: Method, builder: ProgramBuilder, options: PassOptions) -> int:
    from kiln.export.quantize import quantize_weights  # (quantize imports passes.usage: no import cycle)

    if options.quantize is None and options.known_quantization is None:
        return 0
    return quantize_weights(method, builder, options.quantize, options.known_quantization)


PIPELINE: tuple[Pass, ...] = (
    Pass("remove_noops", _method_only(remove_noops), "identity reshapes/permutes/expands/casts/slices, copies"),
    Pass("collapse_chains", _method_only(collapse_chains), "reshape/permute/expand/exact-cast chains"),
    Pass("fold_constants", _with_builder(fold_constants), "weight-only subgraphs computed at export"),
    Pass("cse", _method_only(eliminate_common_subexpressions), "repeated computations merged"),
    Pass("canonicalize_linear", _with_builder(canonicalize_linear), "matmul by a constant weight (+ bias) as linear"),
    Pass("fuse_experts", _with_builder(fuse_experts),
         "a mixture-of-experts layer's gathered expert products as gathered_linear nodes"),
    Pass("fuse_router", _method_only(fuse_router),
         "a mixture-of-experts router's softmax, top-k and renormalization as one route_experts node"),
    Pass("fuse_projections", lambda method, builder, options: fuse_projections(method, builder,
                                                                                options.known_quantization),
         "linears on one input stacked into one (q/k/v, gate/up)"),
    Pass("fold_batch_norm", _with_builder(fold_batch_norm), "inference batch norm folded into the conv before it"),
    Pass("fuse_conv", _method_only(fuse_conv), "zero pads and activations fused into convolutions"),
    Pass("absorb_repeat_kv", _method_only(absorb_repeat_kv), "GQA key/value repetition absorbed by sdpa"),
    Pass("fuse_rms_norm", _with_builder(fuse_rms_norm), "hand-written RMSNorm as one rms_norm node"),
    Pass("fuse_residual_norm", _method_only(fuse_residual_norm), "residual add + rms_norm as one add_rms_norm node"),
    Pass("fuse_rope", _method_only(fuse_rope), "rotate-half rotary embeddings as one rope node"),
    Pass("fuse_gated_mlp", _method_only(fuse_gated_mlp), "act(gate) * up as one gated_activation node"),
    Pass("quantize_weights", _quantize, "linear/embedding weights quantized as the export asked (quantize=)"),
    Pass("remove_noops_after", _method_only(remove_noops), "no-ops the fusions exposed"),
    Pass("fuse_combine", _method_only(fuse_combine),
         "a mixture-of-experts layer's weighted sum of each token's expert rows folded into its gathered linear"),
    Pass("in_place_state_writes", _method_only(mark_in_place_state_writes), "KV-cache writes made in place"),
    Pass("fuse_rope_cache_update", _method_only(fuse_rope_cache_update),
         "RoPE of q and k and the KV-cache writes before an attention as one rope_cache_update node"),
    Pass("fuse_qk_norm", _method_only(fuse_qk_norm),
         "per-head RMSNorms of q and k folded into their rope_cache_update (norm_rope_cache_update)"),
    Pass("fuse_gated_linear", _method_only(fuse_gated_linear),
         "a stacked gate/up (quantized, gathered) linear and the gated activation of its halves as one node"),
    Pass("fuse_router_norm", _method_only(fuse_router_norm),
         "a mixture-of-experts block's residual add + rms_norm and its router's linear layer and pick as one node"),
    Pass("fuse_norm_linear", _method_only(fuse_norm_linear),
         "residual add + rms_norm and the (quantized) linear reading the norm as one node"),
)


def run_passes(method: Method, builder: ProgramBuilder, skip: Collection[str] = (),
               options: PassOptions = PassOptions()) -> dict:
    """Run PIPELINE (but the passes named in `skip`) on `method`; returns {"nodes": count as lowered, "passes":
    [[name, rewrites, nodes after], ...]}."""
    eliminate_dead_code(method)
    stats = {"nodes": len(method.nodes), "passes": []}
    for p in PIPELINE:
        if p.name in skip:
            continue
        changed = p.run(method, builder, options)
        eliminate_dead_code(method)
        stats["passes"].append([p.name, changed, len(method.nodes)])
    return stats


def encode_stats(stats: dict[str, dict]) -> str:
    return json.dumps(stats, separators=(",", ":"))
