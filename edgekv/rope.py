"""Rotary position embeddings, every variant in one place: what each pair of a head's dims turns
by per position. The backends' rope ops take only that (`Rope.freqs`), so none, linear, llama3
frequency factors, YaRN and LongRoPE all run on every backend, fused decode block and op-by-op
alike.

As llama.cpp computes them (ggml's rope with freq_factors, ext_factor and attn_factor; see
`from_gguf`), pair i of n_rot rotated dims turns by pos * freqs[i] with

    theta_i = base ** (-2i / n_rot) / ff_i               ff: rope_freqs.weight (llama3), LongRoPE's
                                                         rope_factors_long/short.weight, else 1
    none / linear:  freqs_i = s * theta_i               s = 1 / rope.scaling.factor (1 for none)
    yarn:           freqs_i = theta_i * (s * (1 - r_i) + r_i)
                    r_i = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1), lo/hi the pairs whose
                    wavelength is n_ctx_orig / beta_fast and n_ctx_orig / beta_slow

and the rotated dims of q and k multiplied by attn_factor (YaRN: 1 + 0.1 ln(1/s); LongRoPE:
rope.scaling.attn_factor, sqrt(1 + ln(n_ctx_train / n_ctx_orig) / ln(n_ctx_orig)) as
convert_hf_to_gguf writes it for Phi-3, applied with the short factors too). Every backend's
rope applies it as ggml does, on cos and sin: with partial rotation (Phi-4-mini: 96 of 128
dims) the dims past n_rot keep their size, so no attention scale could stand in for it.

LongRoPE (phi3) picks its factors once per context, as llama.cpp's get_rope_factors does: the
long ones when the context the model runs with (n_ctx, rounded up to a multiple of 256 as
llama.cpp pads it) exceeds rope.scaling.original_context_length, else the short ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import ModelFileError, UnsupportedModelError

YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's defaults (only grok/mistral3 read their own)
SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # longrope: the factor tensors do it


@dataclass(frozen=True, eq=False)
class Rope:
    freqs: np.ndarray  # (n_rot/2,) float64: pair i turns by pos * freqs[i] radians
    neox: bool  # pairs (i, i + n_rot/2) (llama.cpp's NEOX) instead of (2i, 2i+1) (NORM)
    attn_factor: float = 1.0  # magnitude of the rotated dims of q and k (YaRN, LongRoPE), applied by rope

    @property
    def n_rot(self) -> int:
        return 2 * self.freqs.shape[0]


def plain(base: float, n_rot: int, neox: bool = False, scale: float = 1.0) -> Rope:
    """Rope without factors: pair i turns by scale * base**(-2i/n_rot) per position."""
    return Rope(rope_freqs(base, n_rot, scale), neox)


def rope_freqs(base: float, n_rot: int, scale: float = 1.0, factors: np.ndarray | None = None,
               yarn: tuple[int, float, float] | None = None) -> np.ndarray:
    """(n_rot/2,) float64 angle per position of each pair (module docstring). scale: linear
    position scale s; factors (n_rot/2,): llama3's per-pair divisors; yarn: (n_ctx_orig,
    beta_fast, beta_slow), mixing s and 1 per pair instead of applying s to all."""
    theta = np.power(np.float64(base), -np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if factors is not None:
        theta = theta / np.asarray(factors, dtype=np.float64)
    if yarn is None:
        return scale * theta
    lo, hi = yarn_corr_dims(n_rot, base, *yarn)
    ramp = 1.0 - np.clip((np.arange(n_rot // 2) - lo) / max(0.001, hi - lo), 0.0, 1.0)  # 1: keep, 0: interpolate
    return theta * (scale * (1.0 - ramp) + ramp)


def yarn_corr_dims(n_rot: int, base: float, n_ctx_orig: int, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """The first and last pair YaRN ramps between (ggml_rope_yarn_corr_dims): pairs turning
    beta_fast times over n_ctx_orig keep their frequency, beta_slow times and slower are
    interpolated."""
    def pair(beta: float) -> float:  # the pair that turns `beta` full circles over n_ctx_orig positions
        return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(pair(beta_fast))), min(n_rot - 1.0, math.ceil(pair(beta_slow)))


def llama3_factors(base: float, n_rot: int, factor: float, low_freq_factor: float, high_freq_factor: float,
                   n_ctx_orig: int) -> np.ndarray:
    """(n_rot/2,) float32: the rope_freqs.weight that convert_hf_to_gguf writes for llama3 rope
    scaling (wavelengths under n_ctx_orig/high_freq_factor kept, over n_ctx_orig/low_freq_factor
    divided by factor, smooth between). edgekv reads the tensor; this is for synthetic files."""
    out = []
    for f in rope_freqs(base, n_rot):
        wavelen = 2 * math.pi / f
        if wavelen < n_ctx_orig / high_freq_factor:
            out.append(1.0)
        elif wavelen > n_ctx_orig / low_freq_factor:
            out.append(factor)
        else:
            smooth = (n_ctx_orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
CTX_PAD = 256  # llama.cpp's context is a multiple of this (n_ctx_seq), and LongRoPE compares that


def from_gguf(f, n_rot: int, neox: bool, base: float | None = None, factors: bool = True,
              n_ctx: int | None = None) -> Rope:
    """The Rope of a GGUF's `<arch>.rope.*` keys and rope_freqs.weight (or LongRoPE's
    rope_factors_long/short.weight), as llama.cpp reads them (llama_model::load_hparams,
    get_rope_factors, llama_context's yarn_attn_factor). base overrides freq_base (gemma3's
    local layers); factors=False ignores the factor tensors (layers that do not use them);
    n_ctx: the context the model runs with, which picks LongRoPE's factors (None: the trained
    context_length, what llama.cpp runs with at n_ctx = 0)."""
    a = f.arch
    base = float(f.get(f"{a}.rope.freq_base", 10000.0, kind=(int, float))) if base is None else base
    scaling = f.get(f"{a}.rope.scaling.type", "linear", kind=str)  # llama.cpp's default when absent
    if scaling not in SCALING_TYPES:
        raise UnsupportedModelError(f"rope scaling {scaling!r} is not supported ({', '.join(SCALING_TYPES)})")
    factor = float(f.get(f"{a}.rope.scaling.factor", 0.0, kind=(int, float)))
    s = 1.0 if scaling == "none" or factor == 0.0 else 1.0 / factor
    attn_factor = float(f.get(f"{a}.rope.scaling.attn_factor", 1.0, kind=(int, float)))
    n_ctx_train = f.get(f"{a}.context_length", 4096, kind=int)
    n_ctx_orig = f.get(f"{a}.rope.scaling.original_context_length", 0, kind=int) or n_ctx_train
    ff = None
    if factors and "rope_freqs.weight" in f.tensors:
        ff = factor_tensor(f, "rope_freqs.weight", n_rot)
    elif factors and any(name in f.tensors for name in LONGROPE_TENSORS):
        if not all(name in f.tensors for name in LONGROPE_TENSORS):
            raise ModelFileError(f"LongRoPE needs both {' and '.join(LONGROPE_TENSORS)}")
        n = n_ctx_train if n_ctx is None else -(-n_ctx // CTX_PAD) * CTX_PAD
        long = n > n_ctx_orig
        ff = factor_tensor(f, LONGROPE_TENSORS[0 if long else 1], n_rot)
    yarn = None
    if scaling == "yarn":
        if base <= 1.0:
            raise ModelFileError(f"metadata key {a}.rope.freq_base is {base:g}; YaRN needs a base above 1")
        yarn = (n_ctx_orig, YARN_BETA_FAST, YARN_BETA_SLOW)
        if s < 1.0:  # ggml's magnitude correction (llama.cpp cancels its own get_mscale against it)
            attn_factor *= 1.0 + 0.1 * math.log(1.0 / s)
    return Rope(rope_freqs(base, n_rot, s, ff, yarn), neox, attn_factor)


def factor_tensor(f, name: str, n_rot: int) -> np.ndarray:
    """(n_rot/2,) float64 per-pair frequency divisors from an F32/F16 tensor, checked."""
    t = f.tensors[name]
    if t.shape != (n_rot // 2,) or t.qtype not in (0, 1):
        raise ModelFileError(f"tensor {name} is {t.type_name} {t.shape}, expected F32 or F16 ({n_rot // 2},)")
    ff = t.as_float().astype(np.float64)
    if not (np.isfinite(ff).all() and (ff > 0).all()):
        raise ModelFileError(f"tensor {name} must hold finite positive factors")
    return ff
