"""The per-head RMSNorms of q and k before a rope_cache_update fold into it: one `norm_rope_cache_update` node.

Qwen3 (dense and MoE) and Gemma 3 normalize each head's row of q and k (`q_norm`, `k_norm`) between the q/k/v
projection and the RoPE. At a GPU's decode step those are two kernels of a few microseconds each beside the one
rope_cache_update kernel, all three cost by their launch and their chain of dependent steps, not by their bytes;
one node lets a backend normalize, rotate and write a head's row in one pass.

Matched: rope_cache_update whose q and k are each rms_norm(x, weight) over the last dim (axes 1, a weight), read
only there, or a permute of that (the norm's rows are the permute's rows when the permute keeps the last dim last:
Llama-style layers transpose [B, L, H, D] to [B, H, L, D] after the norm), with one eps for both. The permute then
reads x itself, and the norm goes. Runs after fuse_rope_cache_update, which makes the node.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import NO_VALUE, Method, Node


def _normalized(usage: Usage, value: int) -> tuple[Node, Node | None] | None:
    """(the rms_norm, the permute after it or None) whose result `value` is, each read only on the way there."""
    permute = usage.producer_of(value, "permute")
    if permute is not None:
        perm = tuple(permute.attrs["perm"])
        if perm[-1] != len(perm) - 1 or not usage.only_reader_may_absorb(value):
            return None
        value = permute.inputs[0]
    norm = usage.producer_of(value, "rms_norm")
    if norm is None or int(norm.attrs["axes"]) != 1 or len(norm.inputs) < 2 or norm.inputs[1] == NO_VALUE:
        return None
    return (norm, permute) if usage.only_reader_may_absorb(value) else None


def fuse_qk_norm(method: Method) -> int:
    """Rewrite each rope_cache_update(rms_norm(q), rms_norm(k), ...) as described above; returns how many."""
    usage = Usage.of(method)
    replace: dict[int, Node] = {}
    gone: set[int] = set()
    for node in method.nodes:
        if node.op != "rope_cache_update":
            continue
        q, k = _normalized(usage, node.inputs[0]), _normalized(usage, node.inputs[1])
        if q is None or k is None or q[0] is k[0] or q[0].attrs.get("eps") != k[0].attrs.get("eps"):
            continue
        inputs = list(node.inputs)
        for at, (norm, permute) in enumerate((q, k)):
            if permute is None:
                inputs[at] = norm.inputs[0]
            else:
                permute.inputs = [norm.inputs[0]]
            gone.add(id(norm))
        replace[id(node)] = Node("norm_rope_cache_update", inputs[:7] + [q[0].inputs[1], k[0].inputs[1]] + inputs[7:],
                                 list(node.outputs), {**node.attrs, "eps": q[0].attrs.get("eps")}, source=node.source)
    method.nodes[:] = [replace.get(id(n), n) for n in method.nodes if id(n) not in gone]
    return len(replace)
