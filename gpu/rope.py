"""Rotary position embeddings (RoPE) with the scaling methods of Hugging Face Llama configurations.

Inverse frequencies follow ``transformers.modeling_rope_utils`` for "default" (no scaling), "linear", "llama3"
and "yarn". The cos/sin table is computed on the CPU in float32, in fixed segments of :data:`SEGMENT` positions,
and then moved to the device: the value for a position never depends on how long the table was when it was
computed, or on the device, which keeps prefills with and without a loaded cache bit-identical.
"""

from __future__ import annotations

import math
import threading

import torch

from gpu.modelfiles import ModelConfig

SEGMENT = 4096


def inv_freq_and_scale(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies of shape (head_dim / 2,), float32 on the CPU; attention factor for cos and sin)."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = config.scaling_type
    scaling = config.rope_scaling or {}
    if kind is None:
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(medium, smoothed, inv_freq_llama), 1.0
    # yarn
    original = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, float(attention_factor)


class RotaryTable:
    """cos and sin of shape (positions, head_dim) in the compute dtype on the device, grown on demand."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.inv_freq, self.attention_factor = inv_freq_and_scale(config)
        self.device = device
        self.dtype = dtype
        self._cos = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self._sin = torch.empty(0, config.head_dim, dtype=dtype, device=device)
        self._lock = threading.Lock()

    def _segment(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(index * SEGMENT, (index + 1) * SEGMENT, dtype=torch.int64).float()
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_factor).to(self.dtype)
        sin = (emb.sin() * self.attention_factor).to(self.dtype)
        return cos.to(self.device), sin.to(self.device)

    def get(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [start, end)."""
        if end > self._cos.shape[0]:
            with self._lock:
                have = self._cos.shape[0] // SEGMENT
                need = -(-end // SEGMENT)
                if need > have:
                    parts = [self._segment(i) for i in range(have, need)]
                    self._cos = torch.cat([self._cos, *(c for c, _ in parts)])
                    self._sin = torch.cat([self._sin, *(s for _, s in parts)])
        return self._cos[start:end], self._sin[start:end]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos, sin: (tokens, head_dim). The Hugging Face (half-split) convention."""
    c, s = cos[:, None, :], sin[:, None, :]
    return x * c + rotate_half(x) * s
