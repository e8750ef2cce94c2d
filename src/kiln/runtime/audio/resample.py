"""Band-limited resampling by a rational factor (44.1 or 48 kHz recordings to the 16 kHz speech models take).

The ratio is reduced to new/orig in lowest terms; each of the `new` output phases is one windowed-sinc filter
(a Hann-windowed low-pass at rolloff x the lower Nyquist rate, `zeros` zero crossings each side) applied to the
input with stride `orig`, the standard polyphase form (as torchaudio's and librosa's sinc resamplers). Filters and
products run in float64; the output has ceil(n * new / orig) samples.

The polyphase filter bank holds new x (orig + 2 x width) taps: small for the usual rates (44.1 kHz -> 16 kHz is
160 x 475), but for a ratio that does not reduce (44101 Hz -> 16 kHz: 16000 x 44135, 5.6 GB) it would be huge. Past
MAX_FILTER_TAPS the same filter is instead evaluated at each output sample's own position, in blocks of outputs,
whose memory is bounded whatever the ratio.
"""

from __future__ import annotations

import math

import numpy as np

MAX_FILTER_TAPS = 1 << 20
"""Largest polyphase filter bank (new x taps float64 values, 8 MiB) built; larger ratios take the direct path."""
BLOCK_VALUES = 1 << 20
"""Output samples x taps evaluated at once on the direct path (8 MiB of float64 per temporary)."""


def resample(x: np.ndarray, rate_in: int, rate_out: int, zeros: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """x ([..., n] float) at rate_out samples per second instead of rate_in."""
    if rate_in <= 0 or rate_out <= 0:
        raise ValueError(f"sample rates must be positive, got {rate_in} -> {rate_out}")
    if rate_in == rate_out:
        return x
    g = math.gcd(rate_in, rate_out)
    orig, new = rate_in // g, rate_out // g
    n = x.shape[-1]
    lead = x.shape[:-1]
    out_dtype = x.dtype if x.dtype.kind == "f" else np.float32
    if x.size == 0:  # (a WAV whose data chunk holds no whole frame: nothing to filter, and reshape(-1, 0) fails)
        return np.zeros((*lead, math.ceil(new * n / orig)), dtype=out_dtype)
    flat = x.reshape(-1, n).astype(np.float64)
    length = math.ceil(new * n / orig)
    if new * (2 * _width(orig, new, zeros, rolloff) + orig) > MAX_FILTER_TAPS:
        out = _direct(flat, orig, new, zeros, rolloff, length)
    else:
        out = _polyphase(flat, orig, new, zeros, rolloff)[:, :length]
    return out.reshape(*lead, length).astype(out_dtype)


def _width(orig: int, new: int, zeros: int, rolloff: float) -> int:
    """Input samples the filter reaches on either side of an output sample's position."""
    return math.ceil(zeros * orig / (min(orig, new) * rolloff))


def _polyphase(flat: np.ndarray, orig: int, new: int, zeros: int, rolloff: float) -> np.ndarray:
    """[rows, n] float64 -> [rows, >= length]: every phase's filter over windows every `orig` input samples."""
    kernels, width = _kernels(orig, new, zeros, rolloff)
    padded = np.pad(flat, ((0, 0), (width, width + orig)))
    # windows of the filter's length every `orig` input samples: [rows, steps, taps]
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernels.shape[1], axis=1)[:, ::orig]
    return np.einsum("rst,pt->rsp", windows, kernels).reshape(len(flat), -1)  # phases interleaved in time order


def _kernels(orig: int, new: int, zeros: int, rolloff: float) -> tuple[np.ndarray, int]:
    """The `new` phase filters [new, 2 * width + orig] and width, the input samples each reaches on either side."""
    cutoff = min(orig, new) * rolloff  # in units where the input rate is orig
    width = _width(orig, new, zeros, rolloff)
    taps = np.arange(-width, width + orig, dtype=np.float64) / orig
    t = (-np.arange(new, dtype=np.float64)[:, None] / new + taps[None, :]) * cutoff
    return _filter(t, zeros, cutoff / orig), width


def _filter(t: np.ndarray, zeros: int, gain: float) -> np.ndarray:
    """The Hann-windowed sinc at t (in zero crossings), zero past +-zeros, times gain."""
    t = np.clip(t, -zeros, zeros)
    window = np.cos(t * np.pi / zeros / 2) ** 2
    t = t * np.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        sinc = np.where(t == 0, 1.0, np.sin(t) / t)
    return sinc * window * gain


def _direct(flat: np.ndarray, orig: int, new: int, zeros: int, rolloff: float, length: int) -> np.ndarray:
    """[rows, n] float64 -> [rows, length], the polyphase filter evaluated at each output's position j * orig / new
    (input sample i weighs filter((i - position) * cutoff / orig)), a block of outputs at a time."""
    cutoff = min(orig, new) * rolloff
    width = _width(orig, new, zeros, rolloff)
    offsets = np.arange(-width, width + 2)  # input samples around floor(position) that the filter can reach
    padded = np.pad(flat, ((0, 0), (width + 1, width + 2)))  # input sample i at padded[i + width + 1]
    out = np.empty((len(flat), length))
    block = max(1, BLOCK_VALUES // len(offsets))
    for start in range(0, length, block):
        j = np.arange(start, min(start + block, length), dtype=np.int64)
        base = j * orig // new  # floor of each output's position, exactly
        frac = (j * orig - base * new) / new
        weights = _filter((offsets[None, :] - frac[:, None]) * (cutoff / orig), zeros, cutoff / orig)
        taken = padded[:, base[:, None] + offsets[None, :] + width + 1]  # [rows, block, taps]
        out[:, start:start + len(j)] = np.einsum("rjt,jt->rj", taken, weights)
    return out
