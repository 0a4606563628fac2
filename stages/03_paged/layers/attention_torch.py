"""Paged attention in plain PyTorch: the reference every other backend is tested against.

It runs on any device (CPU included) and favours clarity over speed: one Python loop
over the sequences, a gather of each sequence's K/V through its block table, and an
explicit causal softmax computed in float32.

KV cache layout (per layer)::

    k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim)
    slot = block_id * block_size + offset_in_block

Query packing: the queries of all sequences are concatenated along dim 0; sequence i
owns rows cu_seqlens_q[i] : cu_seqlens_q[i+1]. Its queries are the *last* q_len_i
positions of its context of context_lens[i] tokens, so one rule covers

* plain prefill                      q_len == context_len
* prefill after a cached prefix /
  an earlier chunk                   q_len <  context_len
* decode                             q_len == 1
"""

import torch


def store_kvcache(
    key: torch.Tensor,  # (N, kv_heads, head_dim)
    value: torch.Tensor,  # (N, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (N,) int32/int64; -1 = do not store this token
) -> None:
    """Write token t's key/value into cache slot slot_mapping[t] (in place)."""
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    # View the cache as a flat list of slots: (num_blocks * block_size, kv_heads, head_dim).
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks,) int, padded with -1
    context_len: int,
) -> torch.Tensor:  # (context_len, kv_heads, head_dim)
    """The first context_len tokens of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].to(device=cache.device, dtype=torch.long)
    return cache[blocks].reshape(-1, *cache.shape[2:])[:context_len]


def paged_attention(
    q: torch.Tensor,  # (N, heads, head_dim), all sequences' queries packed
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    cu_seqlens_q: torch.Tensor,  # (num_seqs + 1,) int, query offsets into q
    context_lens: torch.Tensor,  # (num_seqs,) int, keys per sequence (cached + new)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, padded with -1
    scale: float,
) -> torch.Tensor:  # (N, heads, head_dim), q.dtype
    """Causal attention of packed queries over a paged KV cache (fp32 math).

    Query j of sequence i sits at absolute position context_lens[i] - q_len_i + j and
    attends to the keys at positions 0 .. that position. GQA: query head h reads kv head
    h // (heads // kv_heads). Sequences with no queries or an empty context give zeros.
    """
    num_heads, kv_heads = q.shape[1], k_cache.shape[2]
    assert num_heads % kv_heads == 0, "heads must be a multiple of kv_heads"
    group = num_heads // kv_heads
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    for i, ctx in enumerate(ctx_lens):
        q_start, q_end = cu[i], cu[i + 1]
        q_len = q_end - q_start
        if q_len == 0 or ctx == 0:
            continue
        assert q_len <= ctx, f"sequence {i}: {q_len} queries but only {ctx} context tokens"
        qi = q[q_start:q_end].float()  # (q_len, H, D)
        k = gather_kv(k_cache, block_tables[i], ctx).float()  # (ctx, KVH, D)
        v = gather_kv(v_cache, block_tables[i], ctx).float()  # (ctx, KVH, D)
        k = k.repeat_interleave(group, dim=1)  # (ctx, H, D): kv head h//group -> query head h
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # (H, q_len, ctx)
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)  # absolute query positions
        k_pos = torch.arange(ctx, device=q.device)
        causal = k_pos[None, :] <= q_pos[:, None]  # (q_len, ctx)
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# The backend interface the Attention layer calls (same names in every backend module).


def paged_prefill_attention(
    q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, max_seqlen_q
):
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)


def paged_decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale):
    cu_seqlens_q = torch.arange(len(context_lens) + 1, dtype=torch.int32)  # one query per sequence
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)
