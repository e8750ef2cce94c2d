"""A mixture-of-experts layer's combine folded into its down projection (gathered_linear's combine input).

After the experts' down projection, transformers' "batched_mm" experts (kiln.models.llm selects them) weigh each
token's k expert rows by the router's weights and add them up:

    gathered_linear(...) [T * k, N] * reshape(weights [T, k], [T * k, 1]) -> reshape [T, k, N] -> sum(dim 1)

On a GPU that is two kernels and a [T * k, N] intermediate per MoE layer (CuPy's product and its reduction over a
middle dim: slow for a prompt's rows, ~50 us a layer for 512 tokens on the H100). Folded into the gathered linear
(`gathered_linear(x, W, index, bias, combine=weights)`, [T, N]) a decode step's down projection sums each token's
k rows in the kernel that makes them (the CUDA backend's gathered_combine) and a prompt's are summed by one kernel
(combine_rows); the other backends multiply and add as the chain did.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import NO_VALUE, Method

GATHERED = ("gathered_linear", "gathered_quantized_linear")
COMBINE_INPUT = {"gathered_linear": 4, "gathered_quantized_linear": 6}  # (the op set's input positions)


def fuse_combine(method: Method) -> int:
    """Fold each sum over a gathered linear's k weighted rows per token into that node; returns how many."""
    usage = Usage.of(method)
    position = {id(node): i for i, node in enumerate(method.nodes)}
    removed: set[int] = set()
    count = 0
    for total in method.nodes:
        if total.op != "sum" or total.attrs.get("keepdim", False):
            continue
        stacked = total.inputs[0]
        shape = method.values[stacked].shape
        if len(shape) != 3 or tuple(d % 3 for d in total.attrs.get("dims", ())) != (1,):
            continue
        tokens, k, n = shape
        regroup = usage.producer_of(stacked, "reshape")
        if regroup is None or not usage.only_reader_may_absorb(stacked):
            continue
        product = usage.producer_of(regroup.inputs[0], "mul")
        if product is None or not usage.only_reader_may_absorb(regroup.inputs[0]):
            continue
        match = _rows_and_weights(method, usage, product.inputs, tokens, k, n)
        if match is None:
            continue
        rows, weights = match
        gathered = usage.producer.get(rows)
        if gathered is None or gathered.op not in GATHERED or not usage.only_reader_may_absorb(rows):
            continue
        dtype = method.values[rows].dtype
        if method.values[weights].dtype != dtype or method.values[total.outputs[0]].dtype != dtype:
            continue
        maker = usage.producer.get(weights)  # (the weights must exist where the gathered node runs)
        if maker is not None and position[id(maker)] > position[id(gathered)]:
            continue
        slot = COMBINE_INPUT[gathered.op]
        gathered.inputs = (gathered.inputs + [NO_VALUE] * slot)[:slot] + [weights]
        gathered.outputs = [total.outputs[0]]
        removed.update((id(regroup), id(product), id(total)))
        count += 1
    method.nodes = [node for node in method.nodes if id(node) not in removed]
    return count


def _rows_and_weights(method: Method, usage: Usage, inputs: list[int], tokens, k, n) -> tuple[int, int] | None:
    """(rows [S, N], weights [T, k]) when the product is rows times the weights reshaped to a [S, 1] column (S is
    T * k: the reshapes on either side say so, symbolic T included)."""
    for a, b in ((0, 1), (1, 0)):
        rows, column = inputs[a], inputs[b]
        rows_shape, column_shape = tuple(method.values[rows].shape), tuple(method.values[column].shape)
        if len(rows_shape) != 2 or rows_shape[1] != n or column_shape != (rows_shape[0], 1):
            continue
        flatten = usage.producer_of(column, "reshape")
        if flatten is not None and tuple(method.values[flatten.inputs[0]].shape) == (tokens, k):
            return rows, flatten.inputs[0]
    return None
