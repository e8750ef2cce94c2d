"""Band-limited resampling by a rational factor (44.1 or 48 kHz recordings to the 16 kHz speech models take).

The ratio is reduced to new/orig in lowest terms; each of the `new` output phases is one windowed-sinc filter
(a Hann-windowed low-pass at rolloff x the lower Nyquist rate, `zeros` zero crossings each side) applied to the
input with stride `orig`, the standard polyphase form (as torchaudio's and librosa's sinc resamplers). Filters and
products run in float64; the output has ceil(n * new / orig) samples.
"""

from __future__ import annotations

import math

import numpy as np


def resample(x: np.ndarray, rate_in: int, rate_out: int, zeros: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """x ([..., n] float) at rate_out samples per second instead of rate_in."""
    if rate_in <= 0 or rate_out <= 0:
        raise ValueError(f"sample rates must be positive, got {rate_in} -> {rate_out}")
    if rate_in == rate_out:
        return x
    g = math.gcd(rate_in, rate_out)
    orig, new = rate_in // g, rate_out // g
    kernels, width = _kernels(orig, new, zeros, rolloff)
    n = x.shape[-1]
    lead = x.shape[:-1]
    flat = x.reshape(-1, n).astype(np.float64)
    padded = np.pad(flat, ((0, 0), (width, width + orig)))
    # windows of the filter's length every `orig` input samples: [rows, steps, taps]
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernels.shape[1], axis=1)[:, ::orig]
    out = np.einsum("rst,pt->rsp", windows, kernels).reshape(len(flat), -1)  # phases interleaved in time order
    length = math.ceil(new * n / orig)
    return out[:, :length].reshape(*lead, length).astype(x.dtype if x.dtype.kind == "f" else np.float32)


def _kernels(orig: int, new: int, zeros: int, rolloff: float) -> tuple[np.ndarray, int]:
    """The `new` phase filters [new, 2 * width + orig] and width, the input samples each reaches on either side."""
    cutoff = min(orig, new) * rolloff  # in units where the input rate is orig
    width = math.ceil(zeros * orig / cutoff)
    taps = np.arange(-width, width + orig, dtype=np.float64) / orig
    t = (-np.arange(new, dtype=np.float64)[:, None] / new + taps[None, :]) * cutoff
    t = np.clip(t, -zeros, zeros)
    window = np.cos(t * np.pi / zeros / 2) ** 2
    t *= np.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        sinc = np.where(t == 0, 1.0, np.sin(t) / t)
    return sinc * window * (cutoff / orig), width
