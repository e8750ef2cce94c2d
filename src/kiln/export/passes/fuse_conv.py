"""Fuse into a convolution what would otherwise be a separate pass over its input or its output.

- A zero `pad` that only feeds a convolution becomes the convolution's own padding (`padding` before,
  `padding_end` after): EfficientNet's TF-style "same" padding is asymmetric and was a full copy of every
  strided convolution's input (13% of EfficientNet-lite0's CPU time).
- A relu, clamp (ReLU6, hardtanh) or hardswish that is the only reader of a convolution's output becomes the
  convolution's `activation`: the backend applies it while the output is still in cache (27% of
  EfficientNet-lite0's CPU time went to separate clamp passes).

Run after batch-norm folding, which needs the convolution output un-activated.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import Method, Node

ACTIVATIONS = {
    "relu": lambda node: {"activation": "clamp", "activation_min": 0.0, "activation_max": None},
    "clamp": lambda node: {"activation": "clamp", "activation_min": node.attrs.get("min"),
                           "activation_max": node.attrs.get("max")},
    "hardswish": lambda node: {"activation": "hardswish"},
}
"""Ops a convolution can absorb, and the conv attributes that say so."""


def fuse_conv(method: Method) -> dict[str, int]:
    """Both fusions, in place; returns how many of each fired."""
    return {"pad": _fold_padding(method), "activation": _fuse_activations(method)}


def _plain_conv(node: Node | None) -> bool:
    return node is not None and node.op == "conv" and not node.attrs.get("transposed", False)


def _fold_padding(method: Method) -> int:
    usage = Usage.of(method)
    removed = set()
    for pad in method.nodes:
        if pad.op != "pad" or pad.attrs.get("mode", "constant") != "constant" or pad.attrs.get("value", 0.0) != 0:
            continue
        conv = usage.sole_reader(pad.outputs[0], "conv")
        if not _plain_conv(conv) or conv.inputs[0] != pad.outputs[0]:
            continue
        nsp = len(conv.attrs["stride"])
        pads = list(pad.attrs["pads"])  # (before, after) pairs from the last dim backwards
        if any(p < 0 for p in pads) or len(pads) > 2 * nsp:
            continue  # crops, or pads the channel/batch dims
        pads += [0] * (2 * nsp - len(pads))
        before = [pads[2 * (nsp - 1 - i)] for i in range(nsp)]
        after = [pads[2 * (nsp - 1 - i) + 1] for i in range(nsp)]
        padding = list(conv.attrs["padding"])
        end = list(conv.attrs.get("padding_end") or padding)
        conv.attrs["padding"] = tuple(p + b for p, b in zip(padding, before))
        conv.attrs["padding_end"] = tuple(e + a for e, a in zip(end, after))
        conv.inputs = [pad.inputs[0], *conv.inputs[1:]]
        removed.add(id(pad))
    method.nodes = [n for n in method.nodes if id(n) not in removed]
    return len(removed)


def _fuse_activations(method: Method) -> int:
    usage = Usage.of(method)
    removed = set()
    for act in method.nodes:
        if act.op not in ACTIVATIONS:
            continue
        conv = usage.producer.get(act.inputs[0])
        if not _plain_conv(conv) or conv.attrs.get("activation", "none") != "none" \
                or not usage.only_reader_may_absorb(conv.outputs[0]):
            continue
        if not method.values[act.inputs[0]].dtype.is_float:
            continue
        conv.attrs.update(ACTIVATIONS[act.op](act))
        conv.outputs = list(act.outputs)
        removed.add(id(act))
    method.nodes = [n for n in method.nodes if id(n) not in removed]
    return len(removed)
