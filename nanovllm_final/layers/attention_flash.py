"""The flash-attn backend: its paged kernels read the same block tables as ours.

Only used when the optional `flash-attn` package is installed (`pip install .[gpu]`);
its paged kernels need `kvcache_block_size` to be a multiple of 256. flash-attn has
no KV-store kernel, so the store is our Triton one. It reads no fp8 cache (make_backend
refuses kv_cache_dtype="fp8" with it; the functions check too)."""

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from ..kernels.attention import store_kvcache  # the backend's store (flash-attn has none)

name = "flash_attn"
capturable = True
capturable_prefill = (
    False  # the prefill reads the longest context on the host: steps with prompts run eagerly
)
fuses_rope = False  # the rotary layer rotates q and k before the attention
decode_queries = 1  # its decode takes one query per sequence


def _no_fp8(k_cache: torch.Tensor, k_scale) -> None:
    if k_cache.dtype == torch.float8_e4m3fn or k_scale is not None:
        raise ValueError(
            "the flash_attn backend does not read an fp8 KV cache (kv_cache_dtype='fp8'); use attention_backend='triton'"
        )


def paged_prefill_attention(
    q,
    k_cache,
    v_cache,
    cu_seqlens_q,
    context_lens,
    block_tables,
    scale,
    max_seqlen_q,
    k_scale=None,
    v_scale=None,
    new_kv=None,
):
    _no_fp8(k_cache, k_scale)
    if new_kv is not None:
        k, v, slot_mapping = new_kv
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    cu_seqlens_k = F.pad(context_lens.cumsum(0, dtype=torch.int32), (1, 0))  # (seqs+1,)
    max_seqlen_k = int(context_lens.max())
    return flash_attn_varlen_func(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=block_tables,
    )  # (tokens, heads, head_dim); causal aligns queries to the end of each context


def paged_decode_attention(
    q,
    k_cache,
    v_cache,
    context_lens,
    block_tables,
    scale,
    order=None,
    k_scale=None,
    v_scale=None,
    new_kv=None,
):
    # `order` is our kernel's launch order; flash-attn schedules its own work
    _no_fp8(k_cache, k_scale)
    if new_kv is not None:
        k, v, slot_mapping = new_kv
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    out = flash_attn_with_kvcache(
        q.unsqueeze(1),
        k_cache,
        v_cache,
        cache_seqlens=context_lens,
        block_table=block_tables,
        softmax_scale=scale,
        causal=True,
    )  # (seqs, 1, heads, head_dim)
    return out.squeeze(1)
