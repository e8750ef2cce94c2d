"""Let scaled dot-product attention absorb the GQA key/value head repetition in front of it.

transformers' `repeat_kv` turns a [.., Hkv, S, E] cache into [.., Hkv * g, S, E] by reshape (insert a unit dim
before S), expand (to g), reshape (merge): a full copy of the KV cache per layer and per step, 3x the cache for
SmolLM2. kiln's `sdpa` already shares a k/v head among g consecutive q heads, which is exactly what
repeat_kv's copy computes (q head h reads kv head h // g), so the pass feeds the un-repeated tensor to `sdpa`
and dead-code elimination drops the copy. `repeat_interleave(k, g, dim=heads)` decomposes into the same three
nodes, so it is absorbed too; `k.repeat(1, g, 1, 1)` tiles (q head h reads kv head h % Hkv) and is not matched.

The pattern is checked shape by shape: any other reshape/expand (a different grouping, a unit dim elsewhere)
is left alone, and the reason is logged at debug level.
"""

from __future__ import annotations

import logging

from kiln.export.passes.usage import Usage
from kiln.ir.graph import Method

log = logging.getLogger("kiln.passes")


def absorb_repeat_kv(method: Method) -> int:
    """Rewrite sdpa's k and v inputs in place; returns how many inputs were un-repeated."""
    usage = Usage.of(method)
    count = 0
    for node in method.nodes:
        if node.op != "sdpa":
            continue
        for slot in (1, 2):
            source = _repeat_kv_source(method, usage, node.inputs[slot])
            if source is not None:
                node.inputs[slot] = source
                count += 1
    return count


def _repeat_kv_source(method: Method, usage: Usage, value: int) -> int | None:
    """The [.., Hkv, S, E] tensor that `value` repeats along heads, or None (with the reason logged)."""
    merge = usage.producer_of(value, "reshape")
    expand = merge and usage.producer_of(merge.inputs[0], "expand")
    insert = expand and usage.producer_of(expand.inputs[0], "reshape")
    if insert is None:
        return None
    shape = method.values
    x = shape[insert.inputs[0]].shape
    unit, repeated, merged = (shape[n.outputs[0]].shape for n in (insert, expand, merge))
    if len(x) < 3:
        return None
    lead, heads, tail = x[:-3], x[-3], x[-2:]
    groups = repeated[-3] if len(repeated) == len(x) + 1 else None
    if unit != (*lead, heads, 1, *tail) or repeated != (*lead, heads, groups, *tail) or not isinstance(groups, int):
        log.debug("sdpa input %s: reshape/expand/reshape is not a head repetition (%s -> %s -> %s -> %s)",
                  shape[value].name, x, unit, repeated, merged)
        return None
    if not isinstance(heads, int) or merged != (*lead, heads * groups, *tail):
        log.debug("sdpa input %s: merged shape %s is not %s heads x %s", shape[value].name, merged, heads, groups)
        return None
    return insert.inputs[0]
