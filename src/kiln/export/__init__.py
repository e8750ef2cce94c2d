"""kiln.export: PyTorch model -> .kiln program. Imports torch (the runtime never does).

    builder = kiln.export(model, (example_input,), dynamic_shapes=...)
    builder.save("model.kiln")

Several methods that share constants and state buffers (a KV cache):

    kiln.export(model, methods={"prefill": kiln.export.Method((tokens, pos), dynamic_shapes=...),
                                "decode": kiln.export.Method((token, pos))})
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import UnsupportedOpsError
from kiln.export.builder import ProgramBuilder
from kiln.export.capture import bound, capture, user_dim_names
from kiln.export.data_dependent import check_bindable
from kiln.export.method import Failures, lower_method, mutated_buffers
from kiln.export.passes import PIPELINE, PassOptions, encode_stats, run_passes
from kiln.export.plan import plan_memory
from kiln.export.quantize import KnownQuantization, Quantize
from kiln.ir.graph import PASS_STATS_KEY


@dataclass
class Method:
    """One method to export: example inputs, optional dynamic shapes, and the module function to trace."""

    args: tuple
    dynamic_shapes: Any = None
    kwargs: dict | None = None
    function: str | None = None
    """Name of the module's function to export; default: the method's own name if the module has it, else
    forward."""
    extra: dict = field(default_factory=dict)


def _normalize(methods: dict[str, Any]) -> dict[str, Method]:
    out = {}
    for name, spec in methods.items():
        if isinstance(spec, Method):
            out[name] = spec
        elif isinstance(spec, tuple) and spec and isinstance(spec[0], (tuple, list)):
            out[name] = Method(tuple(spec[0]), spec[1] if len(spec) > 1 else None)
        else:
            raise TypeError(f"method {name!r}: give kiln.export.Method(args, dynamic_shapes) or (args, "
                            f"dynamic_shapes), got {type(spec).__name__}")
    return out


def export(module: torch.nn.Module, example_args: tuple | None = None, dynamic_shapes: Any = None,
           methods: dict[str, Any] | None = None, metadata: dict[str, str] | None = None,
           progress: Callable[[str], None] | None = None, skip_passes: Collection[str] = (),
           quantize: Quantize | str | None = None,
           known_quantization: KnownQuantization | None = None) -> ProgramBuilder:
    """Export `module` to a kiln program (call `.save(path)` on the result).

    example_args: inputs for `forward` (a tuple). dynamic_shapes: as torch.export takes it (torch.export.Dim per
    dynamic axis). methods: instead of example_args, several named methods, each a `kiln.export.Method` (or an
    `(args, dynamic_shapes)` tuple); a method traces the module function of the same name when there is one, else
    forward. Buffers that any method mutates become state buffers shared by all methods.
    metadata: string entries stored in the file, added to the module's own `kiln_metadata` dict if it has one.
    skip_passes: names of graph passes (kiln.export.passes.PIPELINE) not to run, e.g. {"fold_constants"} to keep
    every op in the graph for a backend's op tests.
    quantize: store linear and embedding weights quantized: a `kiln.export.Quantize("int4", group_size=64,
    symmetric=True)` or just its mode ("int8", "int4", "bf16", "fp16"); see kiln.export.quantize.
    known_quantization: weights whose quantized form is known already (e.g. kiln.models.gguf_quant's
    GGUFQuantization of the file the model was loaded from), stored in that form exactly; quantize then applies
    to the other weights only. A model quantized with torchao (IntxWeightOnlyConfig, Int8WeightOnlyConfig) is
    found out by itself (kiln.export.torchao_weights); other torchao weight types raise UnsupportedQuantizationError.

    Raises UnsupportedOpsError listing every op that cannot be lowered, and every op whose result size depends on
    tensor values (`.item()`, nonzero) rather than on input shapes, before anything is written. Where torch.export's
    non-strict capture fails, strict capture is tried (with a logged warning); TorchExportError if both fail.
    """
    if isinstance(quantize, str):
        quantize = Quantize(quantize)
    found = None  # known quantization export finds by itself (it reports it; a caller reports its own)
    if known_quantization is None and "torchao" in sys.modules:  # (a torchao-quantized model has imported it)
        from kiln.export.torchao_weights import torchao_quantization

        known_quantization = found = torchao_quantization(module)
    unknown = set(skip_passes) - {p.name for p in PIPELINE}
    if unknown:
        raise ValueError(f"unknown passes {sorted(unknown)}; the passes are {[p.name for p in PIPELINE]}")
    if (example_args is None) == (methods is None):
        raise TypeError("give either example_args (for forward) or methods={name: Method(...)}")
    if methods is None:
        if not isinstance(example_args, (tuple, list)):
            example_args = (example_args,)
        specs = {"forward": Method(tuple(example_args), dynamic_shapes)}
    else:
        specs = _normalize(methods)
    say = progress or (lambda msg: None)
    # restore each submodule's own mode afterwards: module.train(flag) would set them all, and a fresh wrapper
    # (training by default) around an eval-mode model would leave the model training (dropout on)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        captured = {}
        for name, spec in specs.items():
            t0 = time.perf_counter()
            function = spec.function or (name if callable(getattr(module, name, None)) else "forward")
            with torch.no_grad():
                captured[name] = capture(bound(module, function), spec.args, spec.kwargs, spec.dynamic_shapes)
            say(f"captured {name} ({function}) in {time.perf_counter() - t0:.1f}s")
    finally:
        for m, mode in modes:
            m.training = mode
    state_names = set().union(*(mutated_buffers(ep) for ep in captured.values()))
    builder = ProgramBuilder()
    failures = Failures()
    pass_stats: dict[str, dict] = {}
    for name, ep in captured.items():
        spec = specs[name]
        placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"][-len(ep.graph_signature.user_inputs):] \
            if ep.graph_signature.user_inputs else []
        names = user_dim_names(spec.dynamic_shapes, placeholders)
        lowered = lower_method(name, ep, builder, state_names, names, failures)
        method = lowered.method
        if lowered.complete:
            options = PassOptions(quantize, known_quantization)
            stats = pass_stats[name] = run_passes(method, builder, skip_passes, options)
            plan_memory(method)
            builder.add_method(method)
            say(f"lowered {name}: {stats['nodes']} nodes, {len(method.nodes)} after passes")
        check_bindable(lowered, failures)  # after the passes: what the file would hold, judged as load will
    if failures.groups:
        raise UnsupportedOpsError(failures.ops())
    for line in found.summary() if found is not None else ():
        say(line)
    from kiln import __version__

    builder.metadata.update({"producer": "kiln", "kiln_version": __version__, "torch_version": torch.__version__,
                             PASS_STATS_KEY: encode_stats(pass_stats)})
    # a model can carry the metadata its users need (e.g. kiln.vision.* preprocessing); explicit entries win
    builder.metadata.update(getattr(module, "kiln_metadata", None) or {})
    builder.metadata.update(metadata or {})
    return builder


class _CallableModule(types.ModuleType):
    """Makes `kiln.export(...)` work even though `kiln.export` is also this package."""

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramBuilder:
        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Method", "ProgramBuilder", "export"]
