"""The RoPE of q and k and the two KV-cache writes before an attention become one `rope_cache_update` node.

A decoder layer's attention over a KV cache reads sdpa(rope(q), cache_k with rope(k) written at the step's
positions, cache_v with v written there): four small nodes per layer between the q/k/v projection and the
attention. On a GPU's decode step each is a kernel of a few microseconds whose cost is mostly its launch and
ramp-up; one node lets a backend do all four in one kernel.

The pattern is anchored on the attention that reads all three results, which pairs each layer's q with its own k
and v (every layer's RoPE reads the same cos and sin, so they alone cannot): an sdpa over a cache [B, Hkv, S, D]
written at dim 2, or a serving program's slot_attention over a cache [slots, S, Hkv, D] written at (slot,
position), whose rotated k [B, Hkv, 1, D] is transposed to [B, 1, Hkv, D] on its way into the cache. There the
fused node takes k before both transposes: one token per sequence with cos and sin [B, 1, 1, D] rotates alike in
either layout, and the transposes go with the rotation they framed. This pass runs after
mark_in_place_state_writes and keeps the writes' in_place mark (both writes must agree). The fused node takes the
place of the last of the four nodes, where everything they read exists.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import Method, Node


def _as_index_put(node: Node | None) -> tuple[int, int, list[int], list[int]] | None:
    """(cache, values, indices, dims) of a KV-cache write: index_put without accumulation, or index_copy."""
    if node is None:
        return None
    if node.op == "index_put" and not node.attrs.get("accumulate", False):
        return node.inputs[0], node.inputs[1], list(node.inputs[2:]), list(node.attrs["dims"])
    if node.op == "index_copy":
        return node.inputs[0], node.inputs[2], [node.inputs[1]], [node.attrs["dim"]]
    return None


SWAP_HEADS_AND_TOKENS = (0, 2, 1, 3)


def _rotated_key(method: Method, usage: Usage, attention: Node, written: int) -> tuple[Node, int, list[Node]] | None:
    """(the rope of k, the k the fused node takes, the nodes it replaces besides the rope) for the value a cache
    write stores, or None: rope(k) itself before an sdpa; before a slot_attention, permute(rope(permute(k))) with
    both permutes SWAP_HEADS_AND_TOKENS and cos [B, 1, 1, D], so that the rotation reads the same cos row for
    every element whichever layout it sees."""
    if attention.op == "sdpa":
        k_rope = usage.producer_of(written, "rope")
        return None if k_rope is None else (k_rope, k_rope.inputs[0], [])
    back = usage.producer_of(written, "permute")
    if back is None or tuple(back.attrs["perm"]) != SWAP_HEADS_AND_TOKENS:
        return None
    k_rope = usage.producer_of(back.inputs[0], "rope")
    if k_rope is None or not usage.only_reader_may_absorb(back.inputs[0]):
        return None
    there = usage.producer_of(k_rope.inputs[0], "permute")
    cos_shape = method.values[k_rope.inputs[1]].shape
    if there is None or tuple(there.attrs["perm"]) != SWAP_HEADS_AND_TOKENS or len(cos_shape) != 4 \
            or cos_shape[1:3] != (1, 1) or method.values[k_rope.inputs[2]].shape != cos_shape:
        return None
    return k_rope, there.inputs[0], [back]


def fuse_rope_cache_update(method: Method) -> int:
    """Rewrite each attention(rope(q), write(k_cache, rope(k)), write(v_cache, v)) as described above; returns how
    many."""
    usage = Usage.of(method)
    position = {id(node): i for i, node in enumerate(method.nodes)}
    fused: list[tuple[Node, list[Node]]] = []
    taken: set[int] = set()  # nodes already in a group (two attentions reading one cache update fuse once)
    for attention in method.nodes:
        if attention.op not in ("sdpa", "slot_attention"):
            continue
        q_rope = usage.producer_of(attention.inputs[0], "rope")
        k_write, v_write = (usage.producer.get(v) for v in attention.inputs[1:3])
        k_parts, v_parts = _as_index_put(k_write), _as_index_put(v_write)
        if q_rope is None or k_parts is None or v_parts is None or k_write is v_write:
            continue
        k_cache, k_rotated, indices, dims = k_parts
        v_cache, v_new, v_indices, v_dims = v_parts
        key = _rotated_key(method, usage, attention, k_rotated)
        if key is None or not usage.only_reader_may_absorb(k_rotated) or key[0] is q_rope:
            continue
        k_rope, k_input, framing = key
        if (indices, dims) != (v_indices, v_dims) or k_cache == v_cache:
            continue
        if q_rope.inputs[1:] != k_rope.inputs[1:] or q_rope.attrs != k_rope.attrs:
            continue  # different cos/sin or layouts: not one rotation
        if k_write.attrs.get("in_place", False) != v_write.attrs.get("in_place", False):
            continue
        group = [q_rope, k_rope, *framing, k_write, v_write]
        if any(id(n) in taken for n in group):
            continue
        last = max(position[id(n)] for n in group)
        outputs = [q_rope.outputs[0], k_write.outputs[0], v_write.outputs[0]]
        if any(position[id(reader)] <= last for o in outputs for reader in usage.reader_nodes.get(o, ())
               if reader not in group):
            continue  # a result read before the fused node's place
        node = Node("rope_cache_update",
                    [q_rope.inputs[0], k_input, v_new, *q_rope.inputs[1:], k_cache, v_cache, *indices],
                    outputs, {"dims": dims, "interleaved": bool(q_rope.attrs.get("interleaved", False)),
                              "in_place": bool(k_write.attrs.get("in_place", False))},
                    source=k_write.source)
        fused.append((node, group))
        taken.update(id(n) for n in group)
    if not fused:
        return 0
    replace = {}
    gone = set()
    for node, group in fused:
        last = max(group, key=lambda n: position[id(n)])
        replace[id(last)] = node
        gone.update(id(n) for n in group if n is not last)
    method.nodes[:] = [replace.get(id(n), n) for n in method.nodes if id(n) not in gone]
    return len(fused)
