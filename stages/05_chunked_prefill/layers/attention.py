import importlib
import os

import torch
from torch import nn

from .context import get_context

BACKEND_MODULES = {
    "torch": ".attention_torch",
    "triton": ".attention_triton",
    "flash_attn": ".attention_flash",
}


def resolve_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype) -> str:
    """Pick the attention implementation. "auto": flash-attn if installed and the block
    size and dtype suit it, else our Triton kernels on CUDA, else the PyTorch reference."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    has_triton = importlib.util.find_spec("triton") is not None
    flash_ok = (
        device.type == "cuda"
        and has_flash
        and block_size % 256 == 0
        and dtype in (torch.float16, torch.bfloat16)
    )
    if name == "auto":
        if flash_ok:
            return "flash_attn"
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "flash_attn" and not flash_ok:
        raise ValueError(
            "attention_backend='flash_attn' needs CUDA, the flash-attn package, a kvcache_block_size that is a multiple of 256 "
            f"and dtype float16 or bfloat16 (got {device.type}, block size {block_size}, {dtype})"
        )
    if name == "triton" and not (
        has_triton and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    ):
        raise ValueError(
            "attention_backend='triton' needs the triton package and a CUDA device (or TRITON_INTERPRET=1 to run it slowly on CPU)"
        )
    return name


class Attention(nn.Module):
    """Causal self-attention over a paged KV cache.

    The cache is a pool of blocks shared by all sequences. A step
    writes the new tokens' K/V into their slots (`slot_mapping`), then each
    sequence's queries attend to its first `context_lens[i]` cached tokens, found
    through its block table. Prefill and decode both read K/V from the cache; the
    backend (PyTorch reference, our Triton kernels, flash-attn) does the work."""

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
        )  # (num_blocks, block_size, kv_heads, head_dim), set by the runner
        self.backend = None  # the backend module, set by the runner

    def set_backend(self, name: str) -> None:
        self.backend = importlib.import_module(BACKEND_MODULES[name], __package__)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim) of the new tokens only
        ctx = get_context()
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_decode:
            return self.backend.paged_decode_attention(
                q, self.k_cache, self.v_cache, ctx.context_lens, ctx.block_tables, self.scale
            )
        return self.backend.paged_prefill_attention(
            q,
            self.k_cache,
            self.v_cache,
            ctx.cu_seqlens_q,
            ctx.context_lens,
            ctx.block_tables,
            self.scale,
            ctx.max_seqlen_q,
        )  # (tokens, heads, head_dim)
