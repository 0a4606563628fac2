import torch
import torch.nn.functional as F
from torch import nn

from .context import get_context


class Attention(nn.Module):
    """Causal self-attention over the packed tokens of several sequences.

    No cache: every call sees every token of every sequence, so each sequence is a
    plain causal attention over itself."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim)
        cu = get_context().cu_seqlens_q
        out = torch.empty_like(q)
        for start, end in zip(cu[:-1], cu[1:]):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # (heads, len, head_dim)
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True
            )
            out[start:end] = o.transpose(0, 1)
        return out  # (tokens, heads, head_dim)
