"""CUDA kernels: the GPU's own (kernel families below: fused NVRTC kernels from the .cu sources, cuBLAS products,
cupyx's special functions) and, for every other op, the portable kernel (kiln.runtime.backends.array_api) bound
to CuPy.

Each follows its CPU kernel's semantics (the op set's docstrings are the contract); the op tests run both on every
op. Float16/bfloat16 math runs in float32 and is rounded back, as PyTorch does. A kernel that declines its
arguments raises OnHost, and the backend runs the op's CPU kernel on the host instead (kiln.runtime.backends.cuda).
"""

from __future__ import annotations

import cupy as cp

import kiln.runtime.backends.cuda.kernels.attention
import kiln.runtime.backends.cuda.kernels.conv
import kiln.runtime.backends.cuda.kernels.elementwise
import kiln.runtime.backends.cuda.kernels.experts
import kiln.runtime.backends.cuda.kernels.index
import kiln.runtime.backends.cuda.kernels.linalg
import kiln.runtime.backends.cuda.kernels.norm
import kiln.runtime.backends.cuda.kernels.quant_linear
import kiln.runtime.backends.cuda.kernels.reduce
import kiln.runtime.backends.cuda.kernels.rope
import kiln.runtime.backends.cuda.kernels.sort  # noqa: F401 - importing the kernel families registers them
from kiln.runtime.backends.array_api import PORTABLE
from kiln.runtime.backends.cuda.kernels.registry import CUDA_KERNELS, OnHost

CUDA_KERNELS.adopt(PORTABLE.kernels, cp)

__all__ = ["CUDA_KERNELS", "OnHost"]
