"""Rotary position embedding (RoPE), with the Llama 3 frequency scaling.

Introduced in stage 00. Angles are computed in float32 from integer positions, as Hugging Face
and vLLM do, then cast to the model dtype. No cos/sin cache is kept: the model computes them once
per forward, for the positions it is given, and every layer reuses them.
"""

import math

import torch
from torch import nn


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Stretch low frequencies for long context (Llama 3.1 `rope_type: llama3`)."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position-dependent angles, rotate-half layout."""

    inv_freq: torch.Tensor  # (head_dim / 2,) float32, a buffer: follows .to(), not saved

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3)")
        self.rope_type = rope_type
        self.register_buffer("inv_freq", self._compute_inv_freq(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta)
        if self.rope_type == "llama3" and self.scaling is not None:  # llama3 comes from scaling
            inv_freq = llama3_inv_freq(inv_freq, self.scaling)
        return inv_freq

    def reset_inv_freq(self) -> None:
        """Recompute the angle table in place (after `to_empty`, which leaves it garbage)."""
        with torch.no_grad():
            self.inv_freq.copy_(self._compute_inv_freq())

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and sin of every angle, each (num_tokens, head_dim)."""
        return rope_cos_sin(positions, self.inv_freq, dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Angular speed of each rotated pair: theta^(-2i / head_dim), (head_dim / 2,) float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin of position * inv_freq, each (T, head_dim): both halves share the angles."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # (T, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q (T, H, D) and k (T, H_kv, D) rotated by the angles of their tokens, cos/sin (T, D)."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
