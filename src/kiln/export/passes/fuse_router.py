"""A mixture-of-experts router's pick as one route_experts node.

transformers' routers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) export as a chain of small ops after the router's
linear layer:

    cast(logits, float32) -> softmax(last dim) -> topk(k) -> [sum(values) -> div(values, sum)] -> cast(values, dtype)

Each is a kernel of its own on a GPU, a few microseconds apiece for a [tokens, E] array, per MoE layer and token: on
the H100 a decode step of Qwen3-30B-A3B's shape spent more on this chain than on the router's weights. As one node a
backend runs it as one kernel (the CUDA backend: a warp per token, softmax and top-k in registers); the others run
the same chain (kiln.runtime.backends.composite). gpt-oss, which picks the top k of the logits first and takes the
softmax of those, keeps its chain.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.dtypes import DType
from kiln.ir.graph import Method, Node

FLOATS = (DType.float32, DType.float16, DType.bfloat16)


def fuse_router(method: Method) -> int:
    """Rewrite each softmax -> topk router chain as a route_experts node in place of its topk; returns how many."""
    usage = Usage.of(method)
    removed: set[int] = set()
    count = 0
    for topk in method.nodes:
        if topk.op != "topk" or not isinstance(topk.attrs.get("k"), int) or not topk.attrs.get("largest", True):
            continue
        probabilities, (values, indices) = topk.inputs[0], topk.outputs
        rank = len(method.values[probabilities].shape)
        if not rank or topk.attrs["dim"] % rank != rank - 1 or method.values[probabilities].dtype != DType.float32:
            continue
        softmax = usage.producer_of(probabilities, "softmax")
        if softmax is None or softmax.attrs["dim"] % rank != rank - 1 or not usage.only_reader_may_absorb(
                probabilities):
            continue
        logits = softmax.inputs[0]
        upcast = usage.producer_of(logits, "cast")
        if upcast is not None and method.values[upcast.inputs[0]].dtype in FLOATS:
            logits = upcast.inputs[0]  # (float32 from a narrower float is exact: the node upcasts itself)
        if method.values[logits].dtype not in FLOATS:
            continue
        absorbed, weights = [softmax], values
        # (top-k values the graph also returns stay as they are: no renormalization or cast is absorbed)
        normalized = None if values in usage.kept else _normalization(method, usage, values, rank)
        if normalized is not None:
            absorbed += normalized
            weights = normalized[-1].outputs[0]
        downcast = usage.sole_reader(weights, "cast")
        if downcast is not None and downcast.attrs["dtype"] in FLOATS:
            absorbed.append(downcast)
            weights = downcast.outputs[0]
        topk.op, topk.inputs, topk.outputs = "route_experts", [logits], [weights, indices]
        topk.attrs = {"k": topk.attrs["k"], "normalize": normalized is not None,
                      "dtype": method.values[weights].dtype}
        removed.update(id(node) for node in absorbed)
        count += 1
    method.nodes = [node for node in method.nodes if id(node) not in removed]
    return count


def _normalization(method: Method, usage: Usage, values: int, rank: int) -> list[Node] | None:
    """[sum, div] when the top-k values are read only by values / sum(values over the last dim, kept)."""
    readers = usage.reader_nodes.get(values, [])
    if len(readers) != 2 or sorted(node.op for node in readers) != ["div", "sum"]:
        return None
    total = next(node for node in readers if node.op == "sum")
    div = next(node for node in readers if node.op == "div")
    dims = tuple(d % rank for d in total.attrs.get("dims", ()))
    if dims != (rank - 1,) or not total.attrs.get("keepdim", False):
        return None
    if usage.sole_reader(total.outputs[0], "div") is not div or div.inputs != [values, total.outputs[0]]:
        return None
    if div.attrs.get("rounding_mode", "none") != "none" or method.values[div.outputs[0]].dtype != DType.float32:
        return None
    return [total, div]
