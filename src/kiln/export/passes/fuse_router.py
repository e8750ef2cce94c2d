"""A mixture-of-experts router's pick as one route_experts node.

transformers' routers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) export as a chain of small ops after the router's
linear layer:

    cast(logits, float32) -> softmax(last dim) -> topk(k) -> [sum(values) -> div(values, sum)] -> cast(values, dtype)

Each is a kernel of its own on a GPU, a few microseconds apiece for a [tokens, E] array, per MoE layer and token: on
the H100 a decode step of Qwen3-30B-A3B's shape spent more on this chain than on the router's weights. As one node a
backend runs it as one kernel (the CUDA backend: a warp per token, softmax and top-k in registers); the others run
the same chain (kiln.runtime.backends.composite). gpt-oss's router picks the top k of the logits first and takes the
softmax of those:

    topk(logits, k) -> [cast] -> softmax(values, last dim) -> [cast]

which is the same pick and the same weights: softmax is monotonic, so the top k of the probabilities are the top k
of the logits (ties to the lower index alike), and the probabilities renormalized over the k are exp(x_i - max) over
the k's sum of them, the max being among the k: the softmax of the k logits. So it becomes route_experts with
normalize too (its weights differ from the chain's by float32 rounding, a few units in the last place).

fuse_router_norm then folds what comes before the pick into it: the MoE block's residual add and RMSNorm (an
add_rms_norm node) and the router's linear layer become one add_rms_norm_route_experts node, whose normalized rows
stay an output for the experts. On the H100 those were three kernels a layer (norm, router GEMV, pick: ~11.5 us of
a Qwen3-30B-A3B-shaped decode layer's ~70) moving a few hundred KB; as one, each block normalizes the row itself,
a warp per expert takes its logit and the last block to finish picks.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Method, Node

FLOATS = (DType.float32, DType.float16, DType.bfloat16)


def fuse_router(method: Method) -> int:
    """Rewrite each softmax -> topk router chain, and each topk -> softmax one (gpt-oss's), as a route_experts node in
    place of its topk; returns how many."""
    usage = Usage.of(method)
    removed: set[int] = set()
    count = 0
    for topk in method.nodes:
        if topk.op != "topk" or not isinstance(topk.attrs.get("k"), int) or not topk.attrs.get("largest", True):
            continue
        absorbed = _logits_first(method, usage, topk)
        if absorbed is not None:
            removed.update(id(node) for node in absorbed)
            count += 1
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


def _logits_first(method: Method, usage: Usage, topk: Node) -> list[Node] | None:
    """gpt-oss's topk -> [upcast] -> softmax -> [cast] over the last dim rewritten as route_experts (normalized) in
    place of topk; the nodes it absorbed, or None where the chain is not that."""
    logits, (values, indices) = topk.inputs[0], topk.outputs
    rank = len(method.values[logits].shape)
    if not rank or topk.attrs["dim"] % rank != rank - 1 or method.values[logits].dtype not in FLOATS:
        return None
    absorbed, probabilities = [], values
    upcast = usage.sole_reader(values, "cast")
    if upcast is not None and upcast.attrs["dtype"] == DType.float32:
        absorbed.append(upcast)
        probabilities = upcast.outputs[0]
    softmax = usage.sole_reader(probabilities, "softmax")
    if softmax is None or softmax.attrs["dim"] % rank != rank - 1:
        return None
    absorbed.append(softmax)
    weights = softmax.outputs[0]
    downcast = usage.sole_reader(weights, "cast")
    if downcast is not None and downcast.attrs["dtype"] in FLOATS:
        absorbed.append(downcast)
        weights = downcast.outputs[0]
    if method.values[weights].dtype not in FLOATS:
        return None
    topk.op, topk.inputs, topk.outputs = "route_experts", [logits], [weights, indices]
    topk.attrs = {"k": topk.attrs["k"], "normalize": True, "dtype": method.values[weights].dtype}
    return absorbed


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


def fuse_router_norm(method: Method) -> int:
    """Rewrite each add_rms_norm -> [reshape to rows] -> linear -> route_experts chain whose logits only the pick
    reads as one add_rms_norm_route_experts node in the add_rms_norm's place; returns how many."""
    usage = Usage.of(method)
    position = {id(node): i for i, node in enumerate(method.nodes)}
    removed: set[int] = set()
    count = 0
    for route in method.nodes:
        if route.op != "route_experts" or not usage.only_reader_may_absorb(route.inputs[0]):
            continue
        linear = usage.producer_of(route.inputs[0], "linear")
        if linear is None:
            continue
        norm = _norm_before(method, usage, linear.inputs[0])
        if norm is None or norm.attrs.get("axes") != 1:
            continue
        weight, bias = (linear.inputs + [NO_VALUE])[1:3]
        if any((maker := usage.producer.get(v)) is not None and position[id(maker)] > position[id(norm)]
               for v in (weight, bias)):
            continue  # computed after the norm: it would not exist where the fused node goes
        x, residual, norm_weight = (norm.inputs + [NO_VALUE])[:3]
        norm.op, norm.inputs = "add_rms_norm_route_experts", [x, residual, norm_weight, weight, bias]
        norm.outputs = [*norm.outputs, *route.outputs]
        norm.attrs = {"axes": 1, "eps": norm.attrs.get("eps"), **route.attrs}
        removed.update((id(linear), id(route)))
        count += 1
    method.nodes = [node for node in method.nodes if id(node) not in removed]
    return count


def _norm_before(method: Method, usage: Usage, rows: int) -> Node | None:
    """The add_rms_norm whose normalized output is `rows`, or is viewed as `rows` [R, D] by a reshape."""
    norm = usage.producer.get(rows)
    if norm is not None and norm.op == "reshape":
        source, shape = norm.inputs[0], method.values[rows].shape
        if len(shape) != 2 or shape[-1] != method.values[source].shape[-1]:
            return None  # (a reshape keeping the last dim to two dims is the rows of every leading dim)
        norm = usage.producer.get(source)
        rows = source
    elif len(method.values[rows].shape) != 2:
        return None
    return norm if norm is not None and norm.op == "add_rms_norm" and norm.outputs[1] == rows else None
