"""Attention over only the keys some query can see, where the mask says which from the method's inputs alone.

An LLM program attends over its whole static KV cache (max_context slots) with a mask that hides the slots not
written yet, so without this a step at position 40 costs what one at the end of the context does: measured on the
CPU build with SmolLM2-135M and a 512-slot cache, a decode step took 134 ms, and 120 ms with attention over 64
keys (docs/benchmarks.md). The CPU backend narrows attention by reading the mask inside its kernel; a compiled MLX
method cannot read values, and its shapes are fixed when it is traced. So the narrowing happens before the run:
a mask computed from the method's inputs and constants alone (the LLM's `key <= position`, a handful of integer
ops) is computed on the host with the CPU backend's kernels, the last key any query sees is rounded up to a
bucket (64, 96, 128, 192, 256, ...: at most 1.5x the keys needed, two compiled variants per doubling), and the
bucket becomes a hint in the plan's signature (Backend.plan_hints), so each bucket has its own compiled method
whose sdpa reads only that many keys. The result is exactly the same: the keys left out are masked out.

slot_attention (the serving programs' attention over a cache of several sequences) is narrowed the same way from
its positions input: the largest position plus one, bucketed, is how many keys of each slot it gathers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kiln.ir import ops
from kiln.ir.graph import Method, Node, ValueKind
from kiln.runtime.backends.mlx.arrays import to_numpy
from kiln.runtime.backends.mlx.constants import ProgramArrays
from kiln.runtime.backends.mlx.kernels import attention

HINT = "mlx.visible_keys@"
"""A plan hint's name: this prefix and the mask value's index; its value, the keys the sdpa nodes reading that
mask attend over."""
EVERY_ROW_HINT = "mlx.every_row_sees@"
"""A plan hint present (value 1) when every query row of the mask sees some key: attention then needs no NaN for
rows that see none."""
MAX_NODES = 32
"""The most nodes a mask's computation may have to be computed on the host before each run."""
SMALLEST = 64


@dataclass(frozen=True)
class HostMask:
    mask: int  # the mask value (an sdpa's bool mask, or a slot_attention's positions)
    nodes: tuple[Node, ...]  # the nodes that compute it, in the method's order
    inputs: tuple[int, ...]  # the positions of the method inputs it reads
    keys: int = 0  # for positions: the keys a slot holds (for a mask, its last dim says)


def bucket(keys: int, total: int) -> int:
    """The smallest of 64, 96, 128, 192, 256, 384, ... that holds `keys`, or `total` where that is not less."""
    size = SMALLEST
    while size < keys:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, total)


def _closure(method: Method, made_by: dict[int, Node], value: int) -> tuple[Node, ...] | None:
    """The nodes computing `value` from inputs and constants only, through integer and bool values (computed the
    same on the host as on the device), or None."""
    seen: dict[int, Node] = {}
    stack = [value]
    while stack:
        v = stack.pop()
        spec = method.values[v]
        if spec.kind in (ValueKind.INPUT, ValueKind.CONSTANT):
            continue
        node = made_by.get(v)
        if spec.kind != ValueKind.TEMP or node is None or spec.dtype.is_float:
            return None
        if id(node) not in seen:
            seen[id(node)] = node
            if len(seen) > MAX_NODES:
                return None
            stack.extend(i for i in node.inputs if i >= 0)
    order = {id(n): k for k, n in enumerate(method.nodes)}
    return tuple(sorted(seen.values(), key=lambda n: order[id(n)]))


def host_masks(arrays: ProgramArrays, method: Method, made_by: dict[int, Node]) -> tuple[HostMask, ...]:
    """The bool masks of the method's sdpa nodes, and the positions of its slot_attention nodes, that can be
    computed on the host from its inputs."""
    def find() -> tuple[HostMask, ...]:
        found = []
        masks = {n.inputs[3]: 0 for n in method.nodes if n.op == "sdpa" and len(n.inputs) > 3 and n.inputs[3] >= 0
                 and method.values[n.inputs[3]].dtype.name == "bool"}
        for n in method.nodes:
            length = method.values[n.inputs[1]].shape[1] if n.op == "slot_attention" else None
            if isinstance(length, int):
                masks[n.inputs[4]] = max(masks.get(n.inputs[4], 0), length)
        for mask, keys in sorted(masks.items()):
            read = {mask} if method.values[mask].kind == ValueKind.INPUT else None
            nodes = () if read else _closure(method, made_by, mask)
            if nodes or read:
                read = read or {i for n in nodes for i in n.inputs}
                found.append(HostMask(mask, nodes, tuple(k for k, v in enumerate(method.inputs) if v in read), keys))
        return tuple(found)
    return arrays.derived(("host masks", method.name, id(method)), find, evaluate=False)


def hints(arrays: ProgramArrays, method: Method, made_by: dict[int, Node], inputs: list[mx.array],
          env: dict[str, int]) -> dict[str, int]:
    """For each host mask, the bucket of keys its attention needs, where that is fewer than it has."""
    from kiln.runtime.backends.cpu import CPUBackend
    from kiln.runtime.session import resolve_attrs

    out: dict[str, int] = {}
    for host in host_masks(arrays, method, made_by):
        values: dict[int, Any] = {method.inputs[k]: to_numpy(inputs[k]) for k in host.inputs}
        for node in host.nodes:
            args = []
            for i in node.inputs:
                if i >= 0 and i not in values and method.values[i].kind == ValueKind.CONSTANT:
                    values[i] = arrays.program.constant(method.values[i].ref)
                args.append(values[i] if i >= 0 else None)
            result = CPUBackend.kernels[node.op](*args, **resolve_attrs(ops.OPS[node.op], node.attrs, env))
            for i, r in zip(node.outputs, result if len(node.outputs) > 1 else (result,)):
                values[i] = np.asarray(r)
        if host.keys:  # a slot_attention's positions
            positions = values[host.mask]
            keys = bucket(int(positions.max()) + 1 if positions.size else 0, host.keys)
            if keys < host.keys:
                out[HINT + str(host.mask)] = keys
            continue
        mask = values[host.mask]
        total = mask.shape[-1] if mask.ndim else 0
        if total == 0:
            continue
        rows = mask.reshape(-1, total)
        if rows.any(axis=1).all():
            out[EVERY_ROW_HINT + str(host.mask)] = 1
        seen = rows.any(axis=0)
        last = total - int(np.argmax(seen[::-1])) if seen.any() else 0
        keys = bucket(last, total)
        if keys < total:
            out[HINT + str(host.mask)] = keys
    return out


def narrowed_sdpa(keys: int | None, every_row_sees: bool) -> Callable[..., mx.array]:
    """sdpa over the first `keys` keys (every key after them is masked out for every query; None: all of them)."""
    def sdpa(q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None = None, sinks: mx.array | None = None,
             *, causal: bool, scale: float | None) -> mx.array:
        if keys is not None and mask is not None and mask.shape[-1] == k.shape[-2] > keys:
            k, v, mask = k[..., :keys, :], v[..., :keys, :], mask[..., :keys]
        return attention.sdpa(q, k, v, mask, sinks, causal=causal, scale=scale, every_row_sees=every_row_sees)
    return sdpa


def sdpa_for(node: Node, env: dict[str, int]) -> Callable[..., mx.array] | None:
    """The sdpa kernel that node's plan hints call for, or None (the plain kernel)."""
    if len(node.inputs) <= 3 or node.inputs[3] < 0:
        return None
    keys = env.get(HINT + str(node.inputs[3]))
    every_row_sees = bool(env.get(EVERY_ROW_HINT + str(node.inputs[3])))
    return None if keys is None and not every_row_sees else narrowed_sdpa(keys, every_row_sees)


def slot_attention_for(node: Node, env: dict[str, int]) -> Callable[..., mx.array] | None:
    """The slot_attention kernel gathering only the keys the node's positions reach (plan hint), or None."""
    keys = env.get(HINT + str(node.inputs[4]))
    return None if keys is None else functools.partial(attention.slot_attention, visible_keys=keys)
