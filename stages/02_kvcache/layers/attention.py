import torch
import torch.nn.functional as F
from torch import nn

from .context import get_context


class Attention(nn.Module):
    """Causal self-attention that reads keys and values from a KV cache.

    NEW in 02_kvcache: each sequence owns one row of the cache, `max_model_len`
    slots long. A step writes the K/V of its new tokens into the row, then the
    queries attend to the whole row prefix: the prompt at prefill, one new token
    against everything before it at decode."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = (
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
        )
        self.k_cache = self.v_cache = torch.tensor(
            []
        )  # (rows, max_model_len, kv_heads, head_dim), set by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim) of the new tokens only
        ctx = get_context()
        self.k_cache.flatten(0, 1).index_copy_(0, ctx.slot_mapping, k)  # store the new K/V
        self.v_cache.flatten(0, 1).index_copy_(0, ctx.slot_mapping, v)
        cu = ctx.cu_seqlens_q
        out = torch.empty_like(q)
        for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
            row, length = ctx.cache_rows[i], ctx.context_lens[i]
            qs = q[start:end].transpose(0, 1)  # (heads, new tokens, head_dim)
            ks = self.k_cache[row, :length].transpose(0, 1)  # (kv_heads, length, head_dim)
            vs = self.v_cache[row, :length].transpose(0, 1)
            # prefill: the prompt attends causally to itself; decode: one query sees all keys
            o = F.scaled_dot_product_attention(
                qs, ks, vs, is_causal=end - start > 1, scale=self.scale, enable_gqa=True
            )
            out[start:end] = o.transpose(0, 1)
        return out  # (tokens, heads, head_dim)
