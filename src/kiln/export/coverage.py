"""Which ATen ops kiln can export: every Core ATen op overload with a status and the reason for it.

Core ATen (`torch.Tag.core`) is the op set a decomposed ExportedProgram contains, so it is the bar for "every model
exports". Each core op is one of:

- supported: it has a lowering in `kiln.export.lower.HANDLERS`, or the exporter handles it without one (symbolic
  sizes become shape expressions), or capture's decomposition table rewrites it into supported ops;
- not applicable: it never appears in an inference graph (backward, random, out= variants, training-mode ops,
  data-dependent scalars). The reasons come from one table of patterns, `NOT_APPLICABLE`;
- not yet: an inference op kiln cannot lower today, with what is missing.

Ops that are not core but that kiln lowers are listed too: capture keeps some whole (linear, sdpa, layer_norm, ...)
because a backend runs them better as one kernel, and a few survive decomposition as they are.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from kiln.export.capture import KEEP_WHOLE, decomposition_table
from kiln.export.lower import HANDLERS
from kiln.export.lower.registry import target_name

aten = torch.ops.aten

SUPPORTED, NOT_APPLICABLE_STATUS, NOT_YET = "supported", "not applicable", "not yet"
STATUSES = (SUPPORTED, NOT_YET, NOT_APPLICABLE_STATUS)

NOT_APPLICABLE: tuple[tuple[str, str], ...] = (
    (r"_backward\.", "backward op: gradients are not computed at inference"),
    (r"^aten\.(?!__)\w*[^_]_\.", "in-place op: torch.export functionalizes the graph, so none reaches lowering"),
    (r"\.out$", "out= variant: an exported graph is functional and never writes into a given tensor"),
    (r"^aten\.(rand|randn|randperm|bernoulli|normal|uniform|exponential|multinomial|poisson)\.",
     "random op: a deterministic inference program has no random number generator"),
    (r"^aten\.native_dropout\.", "dropout (random); in eval() mode it is removed before export"),
    (r"^aten\._local_scalar_dense\.",
     "data-dependent scalar (tensor.item()): the value is unknown ahead of time; kiln programs keep values in tensors"),
    (r"^aten\._native_batch_norm_legit\.default$",
     "training-mode batch norm that updates running statistics; export the model in eval() mode"),
)
"""(regular expression over the op's name, reason) pairs; the first that matches decides."""

_NOT_APPLICABLE = tuple((re.compile(p), r) for p, r in NOT_APPLICABLE)

SHAPE_OPS = {
    aten.sym_size.int: "the size of a dim",
    aten.sym_numel.default: "the number of elements",
    aten.sym_stride.int: "the stride of a dim",
    aten.sym_storage_offset.default: "the storage offset",
}
"""Ops whose result is a SymInt: the exporter never emits a node for them (method.py skips nodes whose value is a
symbolic int) and their consumers read the value from node.meta as a shape expression."""

MISSING: dict[str, str] = {
    "aten._fft_r2c.default": "complex dtypes: kiln's format and runtime have no complex tensors",
    "aten._fft_c2r.default": "complex dtypes: kiln's format and runtime have no complex tensors",
}
"""What is missing for a not-yet op, where it is more than 'a lowering and a kernel'."""


@dataclass(frozen=True)
class OpStatus:
    name: str
    status: str
    reason: str
    core: bool = True


def core_ops() -> list[torch._ops.OpOverload]:
    """Every Core ATen op overload, sorted by name."""
    # Every registered schema, not dir(aten): torch.ops.aten lists only the packets something has touched so far.
    names = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")}
    found = []
    for packet_name in sorted(names):
        packet = getattr(aten, packet_name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.core in op.tags:
                found.append(op)
    return sorted(found, key=target_name)


def not_applicable_reason(name: str) -> str | None:
    for pattern, reason in _NOT_APPLICABLE:
        if pattern.search(name):
            return reason
    return None


def classify(op: torch._ops.OpOverload, decomposed: set | None = None) -> OpStatus:
    """The status of one core op (`decomposed`: the ops capture decomposes; computed when not given)."""
    name = target_name(op)
    reason = not_applicable_reason(name)
    if reason is not None:
        return OpStatus(name, NOT_APPLICABLE_STATUS, reason)
    if op in HANDLERS:
        return OpStatus(name, SUPPORTED, "lowered")
    if op in SHAPE_OPS:
        return OpStatus(name, SUPPORTED, f"shape expression: {SHAPE_OPS[op]}, symbolic under dynamic shapes")
    if op in (decomposition_table() if decomposed is None else decomposed):
        return OpStatus(name, SUPPORTED, "decomposed at capture into supported ops")
    return OpStatus(name, NOT_YET, MISSING.get(name, "no lowering yet"))


def core_coverage() -> list[OpStatus]:
    decomposed = set(decomposition_table())
    return [classify(op, decomposed) for op in core_ops()]


def extra_lowerings() -> list[OpStatus]:
    """The non-core ATen ops kiln lowers: kept whole at capture, or left as they are by the decomposition."""
    keep = set(KEEP_WHOLE)
    out = []
    for target in HANDLERS:
        if not isinstance(target, torch._ops.OpOverload) or torch.Tag.core in target.tags:
            continue
        reason = "kept whole at capture (one fused kernel)" if target in keep else "lowered where it appears"
        out.append(OpStatus(target_name(target), SUPPORTED, reason, core=False))
    return sorted(out, key=lambda s: s.name)


def counts(statuses: list[OpStatus]) -> dict[str, int]:
    c = Counter(s.status for s in statuses)
    return {status: c.get(status, 0) for status in STATUSES}


def report() -> dict:
    """Everything `kiln ops --json` prints: core ops with counts, and the extra (non-core) lowerings."""
    core = core_coverage()
    return {"core": [asdict(s) for s in core], "counts": counts(core),
            "non_core": [asdict(s) for s in extra_lowerings()]}


__all__ = ["MISSING", "NOT_APPLICABLE", "OpStatus", "SHAPE_OPS", "classify", "core_coverage", "core_ops", "counts",
           "extra_lowerings", "not_applicable_reason", "report"]
