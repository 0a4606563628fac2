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

An fp8 cache (kv_cache_dtype="fp8"; attention.py states the contract): `quantize` on
store, `dequantize` on the gathered K/V.
"""

import torch
import torch.nn.functional as F

name = "torch"
capturable = False  # it reads sizes on the host (.tolist())
capturable_prefill = False  # nor can its prefill
fuses_rope = False  # the rotary layer rotates q and k before the attention
decode_queries = 1  # its decode takes one query per sequence
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., kv_heads, head_dim) / scale (kv_heads,) as float8 e4m3, saturated at +-448."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored e4m3 values (..., kv_heads, head_dim) times scale (kv_heads,), in float32, cast to `dtype`."""
    return (x.float() * scale[:, None]).to(dtype)


def store_kvcache(
    key: torch.Tensor,  # (N, kv_heads, head_dim)
    value: torch.Tensor,  # (N, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # (N,) int32/int64; -1 = do not store this token
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32, for an fp8 cache
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write token t's key/value into cache slot slot_mapping[t] (in place), quantized for an fp8 cache."""
    slots = slot_mapping.to(device=key.device, dtype=torch.long)
    if bool((slots < 0).any()):  # (padding rows store nothing)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]  # (stored, kv_heads, head_dim)
    # View the cache as a flat list of slots: (num_blocks * block_size, kv_heads, head_dim).
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8:
        key, value = quantize(key, k_scale), quantize(value, v_scale)
    k_flat[slots] = key.to(k_cache.dtype)
    v_flat[slots] = value.to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    block_table: torch.Tensor,  # (max_blocks,) int, padded with -1
    context_len: int,
) -> torch.Tensor:  # (context_len, kv_heads, head_dim)
    """The first context_len tokens of one sequence, read through its block table."""
    last = (context_len - 1) // cache.shape[1]  # the block holding the last token
    blocks = block_table[: last + 1].to(device=cache.device, dtype=torch.long)
    return cache[blocks].reshape(-1, *cache.shape[2:])[:context_len]


def paged_attention(
    q: torch.Tensor,  # (N, heads, head_dim), all sequences' queries packed
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    cu_seqlens_q: torch.Tensor,  # (num_seqs + 1,) int, query offsets into q
    context_lens: torch.Tensor,  # (num_seqs,) int, keys per sequence (cached + new)
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, padded with -1
    scale: float,
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32, for an fp8 cache
    v_scale: torch.Tensor | None = None,
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
        k = gather_kv(k_cache, block_tables[i], ctx)  # (ctx, KVH, D)
        v = gather_kv(v_cache, block_tables[i], ctx)  # (ctx, KVH, D)
        if k_cache.dtype == FP8:
            k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        k, v = k.float(), v.float()
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


# The backend's prefill and decode (attention.py): the same causal softmax as paged_attention, in
# fewer operations (a CPU step runs them one by one, each costing microseconds): torch's fused
# scaled_dot_product_attention, with GQA, over the sequences of a step whose queries are equally
# many at once (every decode step, and a verify step of speculative decoding).

SCORES_PER_CHUNK = 1 << 24  # float32 scores computed at once (64 MiB): bounds a large step's memory


def batched_attention(
    q: torch.Tensor,  # (seqs, q_len, heads, head_dim): each sequence's last q_len positions
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,  # (seqs,) int, each >= q_len
    block_tables: torch.Tensor,  # (seqs, max_blocks) int32, padded with -1
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # (seqs, q_len, heads, head_dim), q.dtype
    """paged_attention for sequences that all feed q_len queries, computed together: their blocks
    are gathered into one padded context, whose keys past each query's position are masked."""
    seqs, q_len = q.shape[:2]
    lens = context_lens.to(device=q.device, dtype=torch.long)  # (seqs,)
    ctx = int(lens.max())
    width = -(-ctx // k_cache.shape[1])  # blocks of the longest context
    blocks = block_tables[:, :width].to(device=k_cache.device, dtype=torch.long)  # (seqs, width)
    # (seqs, ctx, kv_heads, head_dim); a padding entry (-1) of a table reads a block of another sequence
    k, v = (cache[blocks].flatten(1, 2)[:, :ctx] for cache in (k_cache, v_cache))
    if k_cache.dtype == FP8:
        k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
    visible = None  # one sequence's one query sees every key
    if seqs > 1 or q_len > 1:
        last = (
            lens[:, None] - q_len + torch.arange(q_len, device=q.device)
        )  # (seqs, q_len) each query's position
        visible = (
            torch.arange(ctx, device=q.device) <= last[:, :, None]
        )  # (seqs, q_len, ctx): keys up to the query
    if (
        seqs > 1
    ):  # past a shorter context, the slots may hold anything (NaN): zeros, which the mask hides
        real = visible[:, -1, :, None, None]  # (seqs, ctx, 1, 1)
        k, v = k.where(real, 0), v.where(real, 0)
    q32, k, v = (x if x.dtype == torch.float32 else x.float() for x in (q, k, v))
    out = F.scaled_dot_product_attention(  # query head h reads kv head h // (heads // kv_heads) (enable_gqa)
        q32.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        None if visible is None else visible[:, None],
        scale=scale,
        enable_gqa=True,
    )  # (seqs, heads, q_len, head_dim)
    return out.transpose(1, 2).to(q.dtype)


def _chunked(
    q, k_cache, v_cache, context_lens, block_tables, scale, k_scale, v_scale
) -> torch.Tensor:
    """batched_attention over chunks of the sequences, each within SCORES_PER_CHUNK scores."""
    seqs, q_len, heads, _ = q.shape
    ctx = int(context_lens.max())
    step = max(1, SCORES_PER_CHUNK // (q_len * heads * ctx))
    if step >= seqs:
        return batched_attention(
            q, k_cache, v_cache, context_lens, block_tables, scale, k_scale, v_scale
        )
    return torch.cat(
        [
            batched_attention(
                q[i : i + step],
                k_cache,
                v_cache,
                context_lens[i : i + step],
                block_tables[i : i + step],
                scale,
                k_scale,
                v_scale,
            )
            for i in range(0, seqs, step)
        ]
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
    if new_kv is not None:
        k, v, slot_mapping = new_kv
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    seqs = len(context_lens)
    if (
        seqs and len(q) == seqs * max_seqlen_q
    ):  # every sequence feeds max_seqlen_q tokens (a verify step)
        q = q.view(seqs, max_seqlen_q, *q.shape[1:])
        return _chunked(
            q, k_cache, v_cache, context_lens, block_tables, scale, k_scale, v_scale
        ).flatten(0, 1)
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        if cu[i + 1] > cu[i] and ctx:
            qi = q[None, cu[i] : cu[i + 1]]  # (1, q_len, heads, head_dim)
            lens, tables = context_lens[i : i + 1], block_tables[i : i + 1]
            out[cu[i] : cu[i + 1]] = batched_attention(
                qi, k_cache, v_cache, lens, tables, scale, k_scale, v_scale
            )[0]
    return out


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
    # `order` is a launch order for GPU kernels: nothing to schedule here
    if new_kv is not None:
        k, v, slot_mapping = new_kv
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _chunked(
        q[:, None], k_cache, v_cache, context_lens, block_tables, scale, k_scale, v_scale
    )[:, 0]
