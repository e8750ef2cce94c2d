"""Fused ops as the sequence of ops they stand for, over one backend's own kernel table.

The export makes a few nodes that exist only so a GPU can run them as one kernel (gated_linear,
add_rms_norm_linear, their quantized forms, gated_gathered_linear, route_experts, add_rms_norm_route_experts and
norm_rope_cache_update). A
backend without that kernel, or a call its kernel does not take (many rows, odd strides), runs them as the ops they
replace: same results, same kernels, no new code per backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.ir.dtypes import DType

Kernels = dict[str, Callable[..., Any]]


def _gated_halves(kernels: Kernels, h: Any, activation: str) -> Any:
    """gated_activation of the first and second halves (views) of a stacked gate/up product's last dim."""
    n = h.shape[-1] // 2
    return kernels["gated_activation"](h[..., :n], h[..., n:], activation)


def gated_linear(kernels: Kernels, x: Any, weight: Any, bias: Any, activation: str) -> Any:
    """linear over the stacked gate/up weight, then gated_activation of its two halves (views)."""
    return _gated_halves(kernels, kernels["linear"](x, weight, bias), activation)


def add_rms_norm_linear(kernels: Kernels, x: Any, residual: Any, norm_weight: Any, weight: Any, bias: Any,
                        axes: int, eps: float | None, activation: str) -> tuple[Any, Any]:
    total, normed = kernels["add_rms_norm"](x, residual, norm_weight, axes, eps)
    if activation:
        return total, gated_linear(kernels, normed, weight, bias, activation)
    return total, kernels["linear"](normed, weight, bias)


def gated_quantized_linear(kernels: Kernels, x: Any, q: Any, scale: Any, zero: Any, bias: Any, bits: int,
                           group_size: int, offset: bool, activation: str) -> Any:
    """quantized_linear over the stacked gate/up weight, then gated_activation of its two halves (views). The
    attributes go by name, as a session passes them (MLX's kernel and the prepared ones take them by name only)."""
    h = kernels["quantized_linear"](x, q, scale, zero, bias, bits=bits, group_size=group_size, offset=offset)
    return _gated_halves(kernels, h, activation)


def add_rms_norm_quantized_linear(kernels: Kernels, x: Any, residual: Any, norm_weight: Any, q: Any, scale: Any,
                                  zero: Any, bias: Any, axes: int, eps: float | None, bits: int, group_size: int,
                                  offset: bool, activation: str) -> tuple[Any, Any]:
    total, normed = kernels["add_rms_norm"](x, residual, norm_weight, axes, eps)
    if activation:
        return total, gated_quantized_linear(kernels, normed, q, scale, zero, bias, bits, group_size, offset,
                                             activation)
    return total, kernels["quantized_linear"](normed, q, scale, zero, bias, bits=bits, group_size=group_size,
                                              offset=offset)


def gated_gathered_linear(kernels: Kernels, x: Any, weight: Any, index: Any, bias: Any, activation: str) -> Any:
    """gathered_linear over the stacked gate/up expert weights, then gated_activation of its two halves (views)."""
    return _gated_halves(kernels, kernels["gathered_linear"](x, weight, index, bias), activation)


def route_experts(kernels: Kernels, logits: Any, k: int, normalize: bool, dtype: DType) -> tuple[Any, Any]:
    last = logits.ndim - 1
    probabilities = kernels["softmax"](kernels["cast"](logits, dtype=DType.float32), dim=last)
    weights, indices = kernels["topk"](probabilities, k=k, dim=last, largest=True)
    if normalize:
        total = kernels["sum"](weights, dims=(last,), keepdim=True)
        weights = kernels["div"](weights, total, rounding_mode="none")
    return kernels["cast"](weights, dtype=dtype), indices


def add_rms_norm_route_experts(kernels: Kernels, x: Any, residual: Any, norm_weight: Any, weight: Any, bias: Any,
                               axes: int, eps: float | None, k: int, normalize: bool,
                               dtype: DType) -> tuple[Any, Any, Any, Any]:
    """add_rms_norm, the router's linear layer over the normalized rows as [R, D], then route_experts."""
    total, normed = kernels["add_rms_norm"](x, residual, norm_weight, axes, eps)
    logits = kernels["linear"](normed.reshape(-1, normed.shape[-1]), weight, bias)
    return (total, normed) + tuple(route_experts(kernels, logits, k, normalize, dtype))


def norm_rope_cache_update(kernels: Kernels, q: Any, k: Any, v: Any, cos: Any, sin: Any, k_cache: Any, v_cache: Any,
                           q_weight: Any, k_weight: Any, *indices: Any, dims: Any, interleaved: bool,
                           eps: float | None, in_place: bool) -> tuple[Any, Any, Any]:
    """rms_norm of q's and k's rows, then rope_cache_update (the attributes by name, as a session passes them)."""
    q = kernels["rms_norm"](q, q_weight, axes=1, eps=eps)
    k = kernels["rms_norm"](k, k_weight, axes=1, eps=eps)
    return kernels["rope_cache_update"](q, k, v, cos, sin, k_cache, v_cache, *indices, dims=dims,
                                        interleaved=interleaved, in_place=in_place)


COMPOSITES: dict[str, Callable[..., Any]] = {
    "gated_linear": gated_linear, "add_rms_norm_linear": add_rms_norm_linear,
    "gated_quantized_linear": gated_quantized_linear, "add_rms_norm_quantized_linear": add_rms_norm_quantized_linear,
    "gated_gathered_linear": gated_gathered_linear, "route_experts": route_experts,
    "add_rms_norm_route_experts": add_rms_norm_route_experts, "norm_rope_cache_update": norm_rope_cache_update}
"""Op name -> its composition, a function of (kernels, *the op's inputs and attributes)."""


def bind(composite: Callable[..., Any], kernels: Kernels) -> Callable[..., Any]:
    """`composite` over `kernels` (looked up at each call, so kernels registered later are the ones it runs)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        return composite(kernels, *args, **kwargs)
    run.__name__ = composite.__name__
    return run

