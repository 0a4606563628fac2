"""Causal self-attention over the paged KV cache, and the backends that compute it.

A backend is a module: attention_torch.py (the PyTorch reference), ../kernels/attention.py
(ours, Triton) or attention_flash.py (the flash-attn package). Each has the same three functions,
which the Attention layer calls, and says five things of itself (`name`; `capturable`: can
a decode step be captured in a CUDA graph, i.e. do its launches read no device values;
`capturable_prefill`: can a step with prompt tokens, at padded token and sequence counts;
`fuses_rope`: do its decode and prefill take q and k unrotated, with `rope`; `decode_queries`:
the most queries per sequence its decode takes, packed as for prefill with cu_seqlens_q and
max_seqlen_q: a step whose sequences feed no more, such as a verify step's 1 + k, runs as a
decode)::

    store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)   token t's k/v into slot slot_mapping[t] (-1: skip)
    paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_seqlen_q, k_scale, v_scale, new_kv[, rope])
    paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, order, k_scale, v_scale, new_kv[, rope, cu_seqlens_q, max_seqlen_q])

    q: (tokens, heads, head_dim), k/v: (tokens, kv_heads, head_dim) of the new tokens
    k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim); slot = block * block_size + offset
    order: None, or (seqs,) int32, the sequences by decreasing context: a launch order only
    new_kv: None, or (k, v, slot_mapping) of the step's new tokens, stored before attending
        (store_kvcache's job; the Triton decode kernel does it itself, saving a launch, and
        the Triton prefill's store rotates q and k in the same launch)
    rope: only where fuses_rope: (positions, cos, sin, q_norm weight, k_norm weight, eps) of
        RotaryEmbedding.kernel_args; q and new_kv's k then come unrotated (and unnormalised);
        with it, in a decode, `counters`: the backend's SplitCounters that the layer keeps for split-K
    k_scale, v_scale: keyword arguments, None unless the cache is float8 e4m3 (kv_cache_dtype="fp8"):
        then (kv_heads,) float32 device tensors; the store writes clamp(x / scale, +-448) rounded to
        e4m3, attention computes with stored * scale (the reference dequantizes its gathered K/V;
        the Triton kernels fold the scales into the softmax scale and the output, in registers).

`make_backend` imports the one asked for, so a missing optional package only matters
when that backend is asked for."""

import importlib
import importlib.util
import os
from types import ModuleType

import torch
from torch import nn

from .context import get_context
from .rotary import RotaryEmbedding

BACKENDS = {
    "torch": ".attention_torch",
    "triton": "..kernels.attention",
    "flash_attn": ".attention_flash",
}


def make_backend(
    name: str,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> ModuleType:
    """The backend for `name`. "auto": flash-attn if installed and the block size, dtype and
    KV-cache dtype (`kv_dtype`, default `dtype`) suit it, else our Triton kernels on CUDA,
    else the PyTorch reference."""
    has_flash = importlib.util.find_spec("flash_attn") is not None
    has_triton = importlib.util.find_spec("triton") is not None
    fp8 = kv_dtype is not None and kv_dtype != dtype
    flash_ok = (
        device.type == "cuda"
        and has_flash
        and block_size % 256 == 0
        and dtype in (torch.float16, torch.bfloat16)
        and not fp8
    )
    if name == "auto":
        name = (
            "flash_attn"
            if flash_ok
            else "triton"
            if device.type == "cuda" and has_triton
            else "torch"
        )
    if name == "flash_attn" and fp8:
        raise ValueError(
            "attention_backend='flash_attn' does not read an fp8 KV cache; with kv_cache_dtype='fp8' use "
            "attention_backend 'triton', 'torch' or 'auto'"
        )
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
    return importlib.import_module(BACKENDS[name], __package__)


class Attention(nn.Module):
    """Causal self-attention over a paged KV cache.

    The cache is a pool of blocks shared by all sequences. A step rotates the new tokens' q
    and k, writes their K/V into their slots (`slot_mapping`), then each sequence's queries
    attend to its first `context_lens[i]` cached tokens, found through its block table. An fp8 cache
    comes with the layer's scales `k_scale`, `v_scale` (see the backend API above)."""

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
        self.k_scale = self.v_scale = (
            None  # (kv_heads,) float32 for an fp8 cache, set by the runner
        )
        self.backend: ModuleType | None = None  # set by the runner
        self.counters = None  # the Triton decode's split-K counters (SplitCounters): they live as long as the layer

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> torch.Tensor:
        # q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim) of the new tokens only,
        # as the qkv projection gives them: `rotary` (after Qwen3's q_norm, k_norm) is applied here
        ctx = get_context()
        extra = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if self.backend.fuses_rope:  # the backend's launches that store and attend rotate q and k
            extra["rope"] = rotary.kernel_args(positions, q_norm, k_norm)
        else:
            q, k = rotary(positions, q, k, q_norm, k_norm)
        new_kv = (k, v, ctx.slot_mapping)  # stored by the backend before it reads the cache
        if ctx.max_seqlen_q <= self.backend.decode_queries:  # one new token each, or a few
            if self.backend.fuses_rope:
                self.counters = self.counters or self.backend.SplitCounters()
                extra["counters"] = self.counters
            if not ctx.is_decode:
                extra |= dict(cu_seqlens_q=ctx.cu_seqlens_q, max_seqlen_q=ctx.max_seqlen_q)
            return self.backend.paged_decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                ctx.context_lens,
                ctx.block_tables,
                self.scale,
                ctx.decode_order,
                new_kv=new_kv,
                **extra,
            )  # (tokens, heads, head_dim)
        return self.backend.paged_prefill_attention(
            q,
            self.k_cache,
            self.v_cache,
            ctx.cu_seqlens_q,
            ctx.context_lens,
            ctx.block_tables,
            self.scale,
            ctx.max_seqlen_q,
            new_kv=new_kv,
            **extra,
        )  # (tokens, heads, head_dim)
