import math

import torch
from torch import nn

from ..kernels import dispatch


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

    cos/sin are precomputed for every position up to `max_positions`. Given `q_norm` and
    `k_norm` (Qwen3's per-head RMSNorms), q and k are normalised first. On CUDA one Triton
    kernel does it all, for q and k (kernels/norm_rope.py's rotary); the PyTorch code is the reference."""

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

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ):
        if dispatch.use_kernel(q):
            if q_norm is None:
                return dispatch.norm_rope.rotary(positions, q, k, self.cos, self.sin)
            assert q_norm.eps == k_norm.eps
            return dispatch.norm_rope.rotary(
                positions, q, k, self.cos, self.sin, (q_norm.weight, k_norm.weight), q_norm.eps
            )
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        # q and k rotated together: a CPU step pays per operation
        qk = torch.cat([q, k], dim=1)  # (tokens, heads + kv_heads, head_dim)
        cos, sin = (
            self.cos[positions].unsqueeze(1),
            self.sin[positions].unsqueeze(1),
        )  # (tokens, 1, head_dim)
        if cos.dtype != q.dtype:
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        qk = _rotate(qk, cos, sin)
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]

    def kernel_args(
        self,
        positions: torch.Tensor,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> tuple:
        """What a kernel that rotates q and k itself needs (attention.py's `rope`): positions,
        the cos and sin tables, the norms' weights (None without them) and epsilon."""
        if q_norm is None:
            return positions, self.cos, self.sin, None, None, 0.0
        assert q_norm.eps == k_norm.eps
        return positions, self.cos, self.sin, q_norm.weight, k_norm.weight, q_norm.eps


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # (tokens, heads, head_dim/2) each
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
