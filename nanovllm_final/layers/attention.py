"""Causal self-attention over the paged KV cache, and the backends that compute it.

A backend is a class with the `AttentionBackend` interface; `make_backend` picks one by
name from `BACKENDS`. The kernels live in attention_torch.py (the PyTorch reference),
attention_triton.py (ours) and attention_flash.py (the flash-attn package); a backend
class imports its module when it is built, so a missing optional package only matters
when that backend is asked for."""

import importlib.util
import os
from typing import Protocol

import torch
from torch import nn

from .context import Context, get_context


class AttentionBackend(Protocol):
    """What the Attention layer needs from a backend. Shapes (per layer)::

        q: (tokens, heads, head_dim), k/v: (tokens, kv_heads, head_dim) of the new tokens
        k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim); slot = block * block_size + offset
    """

    name: str
    capturable: bool  # can a decode step be captured in a CUDA graph (no host reads of device values)?

    def store_kvcache(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write token t's k/v into slot slot_mapping[t] (-1: skip)."""

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
        """Causal attention of packed queries (sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1],
        the last positions of its context_lens[i] cached tokens). Returns (tokens, heads, head_dim)."""

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Context, scale: float) -> torch.Tensor:
        """One query per sequence, at position context_lens[i] - 1. Returns (seqs, heads, head_dim)."""


class TorchBackend:
    """Plain PyTorch: runs everywhere, the reference the others are tested against."""

    name, capturable = "torch", False

    def __init__(self):
        from . import attention_torch as ops

        self.ops = ops
        self.store_kvcache = ops.store_kvcache

    def prefill(self, q, k_cache, v_cache, ctx, scale):
        return self.ops.paged_attention(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, scale)

    def decode(self, q, k_cache, v_cache, ctx, scale):
        cu_seqlens_q = torch.arange(len(ctx.context_lens) + 1, dtype=torch.int32)  # one query per sequence
        return self.ops.paged_attention(q, k_cache, v_cache, cu_seqlens_q, ctx.context_lens, ctx.block_tables, scale)


class TritonBackend:
    """Our Triton kernels: the fast path on CUDA without flash-attn (TRITON_INTERPRET=1 runs them on CPU)."""

    name, capturable = "triton", True

    def __init__(self):
        from . import attention_triton as ops

        self.ops = ops
        self.store_kvcache = ops.store_kvcache

    def prefill(self, q, k_cache, v_cache, ctx, scale):
        return self.ops.paged_prefill_attention(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, scale, ctx.max_seqlen_q)

    def decode(self, q, k_cache, v_cache, ctx, scale):
        return self.ops.paged_decode_attention(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, scale)


class FlashAttnBackend(TritonBackend):
    """The flash-attn package's paged kernels (block sizes that are multiples of 256); our store kernel."""

    name, capturable = "flash_attn", True

    def __init__(self):
        super().__init__()
        from . import attention_flash as flash

        self.flash = flash

    def prefill(self, q, k_cache, v_cache, ctx, scale):
        return self.flash.paged_prefill_attention(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_tables, scale, ctx.max_seqlen_q)

    def decode(self, q, k_cache, v_cache, ctx, scale):
        return self.flash.paged_decode_attention(q, k_cache, v_cache, ctx.context_lens, ctx.block_tables, scale)


BACKENDS: dict[str, type] = {"torch": TorchBackend, "triton": TritonBackend, "flash_attn": FlashAttnBackend}


def make_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype) -> AttentionBackend:
    """The backend for `name`. "auto": flash-attn if installed and the block size and dtype
    suit it, else our Triton kernels on CUDA, else the PyTorch reference."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    has_triton = importlib.util.find_spec("triton") is not None
    flash_ok = device.type == "cuda" and has_flash and block_size % 256 == 0 and dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        name = "flash_attn" if flash_ok else "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "flash_attn" and not flash_ok:
        raise ValueError(
            "attention_backend='flash_attn' needs CUDA, the flash-attn package, a kvcache_block_size that is a multiple of 256 "
            f"and dtype float16 or bfloat16 (got {device.type}, block size {block_size}, {dtype})"
        )
    if name == "triton" and not (has_triton and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")):
        raise ValueError("attention_backend='triton' needs the triton package and a CUDA device (or TRITON_INTERPRET=1 to run it slowly on CPU)")
    return BACKENDS[name]()


class Attention(nn.Module):
    """Causal self-attention over a paged KV cache.

    The cache is a pool of blocks shared by all sequences. A step writes the new tokens'
    K/V into their slots (`slot_mapping`), then each sequence's queries attend to its
    first `context_lens[i]` cached tokens, found through its block table."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])  # (num_blocks, block_size, kv_heads, head_dim), set by the runner
        self.backend: AttentionBackend | None = None  # set by the runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim) of the new tokens only
        ctx = get_context()
        self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        if ctx.is_decode:
            return self.backend.decode(q, self.k_cache, self.v_cache, ctx, self.scale)  # (seqs, heads, head_dim)
        return self.backend.prefill(q, self.k_cache, self.v_cache, ctx, self.scale)  # (tokens, heads, head_dim)
