"""The CPU's convolution and max pooling: compiled 2-d float32 paths (depthwise, Winograd F(2x2, 3x3), im2col in
cache-sized bands), the portable ones (kiln.runtime.backends.array_api.conv) for everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.runtime.backends.array_api import conv as portable
from kiln.runtime.backends.cpu import forms, native
from kiln.runtime.backends.cpu.registry import LOW_PRECISION, kernel, upcast

_conv_out = portable.conv_out


@kernel("conv")
def conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, stride, padding, dilation, groups: int,
         transposed: bool, output_padding, padding_end, activation: str, activation_min: float | None,
         activation_max: float | None) -> np.ndarray:
    dtype = x.dtype
    x, weight, bias = upcast(x, weight, bias)
    padding_end = tuple(padding_end) or tuple(padding)
    act = (activation, activation_min, activation_max)
    out = None if transposed else _conv2d_compiled(x, weight, bias, stride, padding, padding_end, dilation, groups,
                                                   act)
    if out is None:
        out = portable.convolve(np, x, weight, stride, padding, padding_end, dilation, groups, transposed,
                                output_padding)
        _epilogue(out, bias, *act)
    return out.astype(dtype, copy=False) if dtype in LOW_PRECISION else out


def _epilogue(out: np.ndarray, bias: np.ndarray | None, activation: str, lo: float | None,
              hi: float | None) -> None:
    """Add the bias per channel and apply the fused activation to a (freshly allocated) conv output, in place: one
    compiled pass for float32, NumPy passes otherwise."""
    lib = native.library()
    if lib is not None and out.dtype == np.float32 and out.flags.c_contiguous and native.float32_contiguous(bias):
        size = int(np.prod(out.shape[2:]))
        lib.kiln_bias_activate_f32(out.ctypes.data, native.address(bias), out.shape[0] * out.shape[1], out.shape[1],
                                   size, native.ACTIVATION_CODES[activation], *native.bounds(lo, hi))
        return
    portable.epilogue(np, out, bias, activation, lo, hi)


@dataclass(frozen=True)
class Route:
    """How a 2-d float32 convolution of given shapes runs: by a compiled route of native/conv.c (ROUTES), or
    "winograd" / "blas" (NumPy's matmul between compiled transforms). Chosen from the shapes alone, so the CPU
    kernel and the native executor, which both call kiln_conv2d_f32 for the compiled routes, agree."""
    name: str
    geometry: tuple[int, ...]
    """n c h w o kh kw sh sw pt pl dh dw oh ow"""
    band: int = 0
    """im2col: output rows a band."""

    @property
    def code(self) -> int | None:
        return ROUTES.get(self.name)

    @property
    def prepared(self) -> bool:
        """Whether the route multiplies by a form of the weight made once (weight_form), not the weight itself."""
        return self.name in ("pointwise", "im2col", "winograd")

    def weight_form(self, weight: np.ndarray) -> np.ndarray:
        """The form of the weight the route multiplies by, made once per weight array (forms): packed for gemm.c,
        Winograd's 16 transformed matrices packed, or the weight as it is."""
        if not self.prepared:
            return weight
        return _winograd_packed(weight) if self.name == "winograd" else forms.packed_gemm_weight(weight)

    @property
    def work_floats(self) -> int:
        n, c, h, w, o, kh, kw, *_, oh, ow = self.geometry
        if self.name == "winograd":
            return 16 * (c + o) * n * ((oh + 1) // 2) * ((ow + 1) // 2)
        return c * kh * kw * self.band * ow if self.name in ("im2col", "blas") else 0


ROUTES = {"depthwise": 0, "direct": 1, "pointwise": 2, "im2col": 3, "rows": 4, "winograd": 5}
"""native/conv.c's route codes."""


def route(x_shape: tuple[int, ...], weight_shape: tuple[int, ...], stride, padding, padding_end, dilation,
          groups: int) -> Route | None:
    """The route of a 2-d float32 convolution (x [n, c, h, w], weight [o, c / groups, kh, kw]), or None where no
    compiled helper applies (the portable convolution, then the epilogue).

    Depthwise runs entirely compiled, 16 channels a vector (depthwise.c), and so do convolutions of an image's few
    channels (direct.c, 16 output channels a vector). 1x1 convolutions of 1x1 maps (squeeze-and-excitation) are a
    linear layer over the images' rows (kiln_linear_rows_f32). Other 1x1 stride-1 convolutions and im2col bands
    multiply by the weight packed once (gemm.c, bias and activation applied as the tiles are stored). 3x3 stride-1
    convolutions on maps big enough use Winograd F(2x2, 3x3), its 16 products by the packed GEMM too. Grouped
    convolutions build im2col compiled, without a padded copy of the input, for BLAS and a pass for the epilogue.

    Every GEMM of one group is packed. From 16 inputs x 24 outputs up that was measured faster than BLAS + a pass
    for the epilogue (EfficientNet-lite0 and MobileNetV3-small, 1 thread: 1.38 / 2.16x ORT's time against 1.58 /
    2.39x with BLAS below 64 x 96); below it BLAS's call alone was faster (16 -> 16 channels on 56x56: 39 us against
    48; 32 -> 16 on 112x112, the 12-row tiles a third padding: 145 against 265). But a BLAS convolution is a Python
    step in the middle of a lowered net: with ONNX Runtime run before each kiln run (as in the interleaved
    benchmark), MobileNetV3-small took 3.00-3.05 -> 2.54-2.55 ms and EfficientNet-lite0 11.4-13.0 -> 10.8 ms once
    every convolution lowered.
    """
    if len(x_shape) != 4 or len(weight_shape) != 4:
        return None
    n, c, h, w = x_shape
    o, cg, kh, kw = weight_shape
    oh, ow = (_conv_out(*args) for args in zip((h, w), (kh, kw), stride, padding, dilation, padding_end))
    if oh <= 0 or ow <= 0 or n == 0 or c == 0:
        return None
    geometry = (n, c, h, w, o, kh, kw, *stride, *padding, *dilation, oh, ow)
    if cg == 1 and groups == c == o:
        return Route("depthwise", geometry)
    if groups == 1 and c <= DIRECT_MAX_INPUTS and kh * kw > 1:
        return Route("direct", geometry)
    if kh == kw == 1 and not any(padding) and not any(padding_end) and groups == 1:
        if h == w == 1:
            return Route("rows", geometry)
        if tuple(stride) == (1, 1):
            return Route("pointwise", geometry)
    if (kh, kw, *stride, *dilation, groups) == (3, 3, 1, 1, 1, 1, 1) and min(c, o) >= _WINOGRAD_MIN_CHANNELS \
            and n * ((oh + 1) // 2) * ((ow + 1) // 2) >= _WINOGRAD_MIN_TILES:
        return Route("winograd", geometry)
    # im2col + GEMM in bands of output rows, each band's patch matrix small enough to stay in cache
    band = max(1, min(oh, _IM2COL_BAND_BYTES // (4 * c * kh * kw * ow)))
    return Route("im2col" if groups == 1 else "blas", geometry, band)


def _conv2d_compiled(x, weight, bias, stride, padding, padding_end, dilation, groups, act) -> np.ndarray | None:
    """2-d float32 convolution through the compiled helpers (bias and activation included), or None where they do
    not apply (route)."""
    lib = native.library()
    if lib is None or x.ndim != 4 or not native.float32_contiguous(weight, bias) or x.dtype != np.float32:
        return None
    r = route(x.shape, weight.shape, stride, padding, padding_end, dilation, groups)
    if r is None:
        return None
    x = np.ascontiguousarray(x)
    if r.name == "blas":
        return _im2col_blas(lib, x, weight, bias, groups, r, act)
    n, _, _, _, o, *_, oh, ow = r.geometry
    out = np.empty((n, o, oh, ow), dtype=np.float32)
    work = np.empty(r.work_floats, np.float32) if r.work_floats else None
    activation, lo, hi = act
    lib.kiln_conv2d_f32(r.code, x.ctypes.data, r.weight_form(weight).ctypes.data,
                        native.address(bias), out.ctypes.data, native.address(work),
                        np.array(r.geometry, np.int64).ctypes.data, r.band, native.ACTIVATION_CODES[activation],
                        *native.bounds(lo, hi), native.threads())
    return out


def _im2col_blas(lib, x, weight, bias, groups: int, r: Route, act) -> np.ndarray:
    """im2col (compiled) in bands of output rows, each band's GEMM by BLAS, then the epilogue."""
    n, c, h, w, o, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow = r.geometry
    k = weight.shape[1] * kh * kw
    cols = np.empty(r.work_floats, dtype=np.float32)
    out = np.empty((n, o, oh * ow), dtype=np.float32)
    w_groups = weight.reshape(groups, o // groups, k)
    for b in range(n):
        for r0 in range(0, oh, r.band):
            r1 = min(oh, r0 + r.band)
            length = (r1 - r0) * ow
            part = cols[:c * kh * kw * length].reshape(c * kh * kw, length)
            lib.kiln_im2col2d_f32(x[b].ctypes.data, part.ctypes.data, c, h, w, kh, kw, sh, sw, pt, pl, dh, dw, r0, r1,
                                  ow)
            target = out[b, :, r0 * ow:r1 * ow].reshape(groups, o // groups, length)
            np.matmul(w_groups, part.reshape(groups, k, length), out=target)
    out = out.reshape(n, o, oh, ow)
    _epilogue(out, bias, *act)
    return out


DIRECT_MAX_INPUTS = 4
"""Convolutions of up to this many input channels (an image's) go to the direct kernel (direct.c)."""

_IM2COL_BAND_BYTES = 1 << 20
"""Patch-matrix size per band of output rows: about half this machine's 2 MiB L2, so the GEMM reads it from cache."""

_WINOGRAD_MIN_TILES = 32
"""Winograd reads 16/9 of the weight bytes; below this many 2x2 output tiles (ResNet's 7x7 maps: 16), the
transformed weights' traffic costs more than the multiplies it saves, and im2col + one GEMM is faster (measured:
64-256 channels at 56x56..14x14, 1.4-2.2x faster than im2col; 512 channels at 7x7, 6% slower)."""
_WINOGRAD_MIN_CHANNELS = 8

_WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])


def _winograd_weight(weight: np.ndarray) -> np.ndarray:
    """U = G g G^T, [16, out, in]."""
    def make(weight: np.ndarray) -> np.ndarray:
        o, c = weight.shape[:2]
        u = np.einsum("ai,ocij,bj->aboc", _WINOGRAD_G, weight.astype(np.float64), _WINOGRAD_G)
        return np.ascontiguousarray(u.reshape(16, o, c), dtype=np.float32)
    return forms.derived("winograd", weight, make)


def _winograd_packed(weight: np.ndarray) -> np.ndarray:
    """U's 16 [out, in] matrices, each packed for gemm.c, one after another (native/conv.c's Winograd route)."""
    def make(weight: np.ndarray) -> np.ndarray:
        return np.concatenate([native.pack_gemm_weight(u) for u in _winograd_weight(weight)])
    return forms.derived("winograd-gemm", weight, make)


@kernel("max_pool")
def max_pool(x: np.ndarray, kernel, stride, padding, dilation, ceil_mode: bool) -> np.ndarray:
    nsp = len(kernel)
    stride = tuple(stride) or tuple(kernel)
    out_sp, extra = portable.pool_geometry(x.shape[-nsp:], kernel, stride, padding, dilation, ceil_mode)
    lib = native.library()
    if lib is not None and nsp == 2 and x.dtype == np.float32 and x.ndim >= 2 and 0 not in out_sp and x.size:
        x = np.ascontiguousarray(x)
        out = np.empty(x.shape[:-2] + out_sp, dtype=np.float32)
        lib.kiln_maxpool2d_f32(x.ctypes.data, out.ctypes.data, x.size // (x.shape[-1] * x.shape[-2]), *x.shape[-2:],
                               *kernel, *stride, *padding, *dilation, *out_sp, native.threads())
        return out
    return portable.max_pool(np, x, kernel, stride, padding, dilation, ceil_mode)
