"""Convolution on the GPU: 2-d maps in the storage types of the fused kernels run as one im2col gather (conv.cu)
and one cuBLAS product per image batch (1x1 stride-1 kernels multiply the input as it is), or as a direct depthwise
kernel; bias and activation are one pass after. Other convolutions (1-d, 3-d, transposed) run the portable
im2col with the product on cuBLAS."""

from __future__ import annotations

import math
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import conv as portable
from kiln.runtime.backends.cuda import cublas, nvrtc
from kiln.runtime.backends.cuda.kernels.linalg import matmul_cublas
from kiln.runtime.backends.cuda.kernels.registry import grid, kernel

ACTIVATIONS = {"none": 0, "clamp": 1, "hardswish": 2}  # as conv.cu numbers them


@kernel("conv")
def conv(x: Any, weight: Any, bias: Any, stride: Any, padding: Any, dilation: Any, groups: int, transposed: bool,
         output_padding: Any, padding_end: Any, activation: str, activation_min: float | None,
         activation_max: float | None) -> Any:
    padding_end = tuple(padding_end) or tuple(padding)
    parts = (x, weight) if bias is None else (x, weight, bias)
    if not transposed and x.ndim == 4 and nvrtc.supports(*parts) and activation in ACTIVATIONS \
            and cublas.supports(x.dtype) and tuple(padding_end) == tuple(padding):
        out = _conv2d(cp.ascontiguousarray(x), cp.ascontiguousarray(weight), bias, tuple(stride), tuple(padding),
                      tuple(dilation), groups, (activation, activation_min, activation_max))
        if out is not None:
            return out
    return portable.conv(cp, x, weight, bias, stride, padding, dilation, groups, transposed, output_padding,
                         padding_end, activation, activation_min, activation_max, matmul=matmul_cublas)


def _act_args(act: tuple[str, float | None, float | None]) -> tuple[np.int32, np.float32, np.float32]:
    name, lo, hi = act
    return (np.int32(ACTIVATIONS[name]), np.float32(-np.inf if lo is None else lo),
            np.float32(np.inf if hi is None else hi))


def _conv2d(x: Any, weight: Any, bias: Any, stride: tuple[int, ...], padding: tuple[int, ...],
            dilation: tuple[int, ...], groups: int, act: tuple[str, float | None, float | None]) -> Any | None:
    n, c, h, w = x.shape
    o, cg, kh, kw = weight.shape
    oh, ow = (portable.conv_out(*args) for args in zip((h, w), (kh, kw), stride, padding, dilation))
    if oh <= 0 or ow <= 0 or 0 in x.shape or o == 0:
        return None
    geometry = (np.int32(c), np.int32(h), np.int32(w), np.int32(kh), np.int32(kw), *map(np.int32, stride),
                *map(np.int32, padding), *map(np.int32, dilation), np.int32(oh), np.int32(ow))
    has_bias = np.int32(bias is not None)
    bias_arg = bias if bias is not None else weight
    if cg == 1 and groups == c == o:
        out = cp.empty((n, c, oh, ow), dtype=x.dtype)
        nvrtc.function("conv", "depthwise2d", x.dtype)(
            grid(out.size), (256,), (x, weight, bias_arg, out, *geometry, np.int64(out.size), has_bias,
                                     *_act_args(act)))
        return out
    length, kk = oh * ow, cg * kh * kw
    if (kh, kw, *stride, *padding) == (1, 1, 1, 1, 0, 0):
        cols = x.reshape(n, groups, kk, length)
    else:
        cols = cp.empty((n, c * kh * kw, length), dtype=x.dtype)
        nvrtc.function("conv", "im2col2d", x.dtype)(grid(cols.size), (256,), (x, cols, *geometry,
                                                                                np.int64(cols.size)))
        cols = cols.reshape(n, groups, kk, length)
    w_groups = weight.reshape(groups, o // groups, kk)
    out = cublas.matmul(w_groups if groups > 1 else w_groups[0], cols if groups > 1 else cols[:, 0])
    out = out.reshape(n, o, oh, ow)
    if bias is not None or act[0] != "none":
        size = math.prod(out.shape[2:])
        nvrtc.function("conv", "bias_activate", x.dtype)(
            grid(out.size), (256,), (out, bias_arg, np.int32(o), np.int64(size), np.int64(out.size), has_bias,
                                     *_act_args(act)))
    return out
