import math

import torch
from torch import nn


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3's frequency scaling: slow the low frequencies by `factor`, keep the high
    ones, and blend smoothly in between (as Hugging Face's `_compute_llama3_parameters`)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "rotate half" layout of Llama and Qwen3).

    cos/sin are precomputed for every position up to `max_positions`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = 1.0 / theta ** (
            torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        )  # (head_dim/2,)
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif rope_type != "default":
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: default, llama3"
            )
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float), inv_freq
        )  # (positions, head_dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (positions, head_dim)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # (tokens, 1, head_dim)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (tokens, heads, head_dim/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
