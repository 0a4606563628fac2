"""The flash-attn backend: its paged kernels read the same block tables as ours.

Only used when the optional `flash-attn` package is installed (`pip install .[gpu]`);
its paged kernels need `kvcache_block_size` to be a multiple of 256. flash-attn has
no KV-store kernel, so the store is our Triton one."""

import torch
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from .attention_triton import store_kvcache  # noqa: F401  (re-exported: the backend's store)


def paged_prefill_attention(
    q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_seqlen_q
):
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


def paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale):
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
