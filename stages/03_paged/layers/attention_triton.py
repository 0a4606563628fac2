"""Paged attention in Triton: our own kernels for the KV-cache store, prefill and decode.

Same semantics as ``attention_torch.py`` (the reference):

    k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim)
    slot = block_id * block_size + offset_in_block

Key position p of sequence i lives in block ``block_tables[i, p // block_size]`` at
offset ``p % block_size``, so any block size works (1, 3, 16, 256, ...).

Kernels
-------
* ``store_kvcache``          one program per token: copy its K/V rows into the cache.
* ``paged_prefill_attention`` FlashAttention-style: one program per (query tile, sequence,
                             query head); loops over key tiles, online softmax in fp32.
* ``paged_decode_attention`` one program per (sequence, kv head[, split]): all query heads
                             of the GQA group share each K/V tile that is loaded. Optional
                             split-K over the context plus a small reduce kernel, so that a
                             few long sequences still fill the GPU.

Conventions: tensors' last dim must be contiguous; every accumulation is fp32; fp32, fp16
and bf16 inputs are supported; head_dim need not be a power of two (BLOCK_D pads it and
masks). To debug on a CPU, set ``TRITON_INTERPRET=1`` before importing triton.
"""

import torch
import triton
import triton.language as tl

# exp(x) == exp2(x * log2(e)): exp2 is the cheaper instruction on GPUs, so the kernels
# fold log2(e) into the softmax scale once and use exp2 everywhere.
LOG2E = 1.4426950408889634


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; pad head_dim to a power of two (masked).
    return max(16, triton.next_power_of_2(head_dim))


# ---------------------------------------------------------------------------------------
# KV-cache store
# ---------------------------------------------------------------------------------------


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,  # (N, KVH, D), strides below, last dim contiguous
    k_cache_ptr,
    v_cache_ptr,  # contiguous (num_blocks * block_size, KVH, D) slots
    slot_mapping_ptr,  # (N,)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    KVH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: big caches overflow int32
    if slot < 0:  # -1 marks a token that must not be stored (e.g. padding)
        return
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    k = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    dst = slot * (KVH * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # (N, kv_heads, head_dim)
    value: torch.Tensor,  # (N, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    slot_mapping: torch.Tensor,  # (N,) int32/int64; -1 = skip this token
) -> None:
    """Write token t's key/value into cache slot slot_mapping[t] (in place)."""
    num_tokens, kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "last dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2:] == (kv_heads, head_dim) and v_cache.shape == k_cache.shape
    if num_tokens == 0:
        return
    # fmt: off
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), KVH=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    # fmt: on


# ---------------------------------------------------------------------------------------
# Shared helper: load one tile of keys (or values) through the block table
# ---------------------------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    cache_ptr,
    block_table_row_ptr,
    offs_n,
    n_mask,
    kv_head,
    offs_d,
    d_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    PAGE_SIZE: tl.constexpr,
):
    """Rows offs_n (key positions of one sequence) of one kv head: [BLOCK_N, BLOCK_D]."""
    # Logical position p -> (physical block, offset in block). PAGE_SIZE is a constexpr
    # so that powers of two compile to shifts/masks.
    block_ids = tl.load(block_table_row_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    row = (
        block_ids.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    )
    ptrs = cache_ptr + row[:, None] + offs_d[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, qk_scale, mask, APPLY_MASK: tl.constexpr):
    """Fold one key tile into the running softmax state of a block of query rows.

    q [ROWS, BLOCK_D], k/v [BLOCK_N, BLOCK_D], mask [ROWS, BLOCK_N] (True = may attend);
    m_i [ROWS] running max (base-2 logits), l_i [ROWS] running sum, acc [ROWS, BLOCK_D].
    Every row must see at least one key in its first tile, so m_i never stays -inf.
    """
    # input_precision="ieee": exact fp32 dots for fp32 inputs (ignored for fp16/bf16).
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [ROWS, BLOCK_N]
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [ROWS]
    alpha = tl.exp2(m_i - m_new)  # rescales the old state to the new max
    p = tl.exp2(s - m_new[:, None])  # [ROWS, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------
# Prefill (general case): packed queries, paged keys, causal
# ---------------------------------------------------------------------------------------


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,  # cache strides: block, slot in block, kv head
    stride_bt,  # block table row stride
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Which BLOCK_M queries of the sequence. Reversed so that the last tiles, which see the
    # most keys, start first: better load balance across the GPU under the causal mask.
    tile_m = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len:  # grid is sized for the longest sequence
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len  # tokens before our first query (cached prefix)

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in sequence
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m  # [BLOCK_M] absolute positions of our queries

    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    # Online softmax state, fp32 (base-2 logits).
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running weighted sum of V

    # Keys [0, full_end) are visible to every query of the tile, keys up to kv_end to the
    # last one; tiles entirely above the diagonal (>= kv_end) are never visited.
    full_end = prefix_len + tile_m * BLOCK_M  # position of our first query
    full_end = (full_end // BLOCK_N) * BLOCK_N  # whole key tiles only
    kv_end = tl.minimum(context_len, prefix_len + (tile_m + 1) * BLOCK_M)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    all_n = tl.full([BLOCK_N], 1, tl.int1)  # "every key of the tile is valid"

    # Phase 1: tiles below the diagonal (the cached prefix, earlier query tiles): no mask.
    for start_n in range(0, full_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        # fmt: off
        k = _load_kv_tile(
            k_cache_ptr, bt_row, offs_n, all_n, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE,
        )  # [BLOCK_N, BLOCK_D]
        v = _load_kv_tile(
            v_cache_ptr, bt_row, offs_n, all_n, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE,
        )  # [BLOCK_N, BLOCK_D]
        # fmt: on
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, m_i, l_i, acc, qk_scale, None, APPLY_MASK=False
        )

    # Phase 2: tiles on the diagonal: mask keys after each query (and past the context).
    for start_n in range(full_end, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        # fmt: off
        k = _load_kv_tile(
            k_cache_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE,
        )
        v = _load_kv_tile(
            v_cache_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE,
        )
        # fmt: on
        causal = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, m_i, l_i, acc, qk_scale, causal, APPLY_MASK=True
        )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # (N, heads, head_dim), all sequences' queries packed
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    cu_seqlens_q: torch.Tensor,  # (num_seqs + 1,) int32
    context_lens: torch.Tensor,  # (num_seqs,) int32, cached + new tokens
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, padded with -1
    scale: float,
    max_seqlen_q: int,  # longest q_len in the batch (sizes the grid, no device sync)
    BLOCK_M: int = 64,
    BLOCK_N: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,  # best on an H200 for head_dim 128 (bf16), see benchmarks/kernel_bench.py
) -> torch.Tensor:  # (N, heads, head_dim), q.dtype
    """Causal attention of packed queries over a paged cache (see attention_torch.py).

    The new tokens' K/V must already be in the cache (call store_kvcache first).
    Query j of sequence i is at position context_lens[i] - q_len_i + j.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    assert num_heads % kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), num_seqs, num_heads)
    # fmt: off
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), GROUP=num_heads // kv_heads,
        HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=_block_d(head_dim), num_warps=num_warps, num_stages=num_stages,
    )
    # fmt: on
    return out


# ---------------------------------------------------------------------------------------
# Decode: one query per sequence, at position context_len - 1
# ---------------------------------------------------------------------------------------
#
# Split-K ("flash decoding"): with few sequences there are too few (sequence, kv head)
# programs to fill the GPU, so each context is cut into num_splits partitions handled by
# separate programs, each writing a partial result + its log-sum-exp, merged by a small
# reduce kernel. num_splits depends only on the batch shape; each sequence's partition
# size is computed *inside* the kernels from its own context_len, so every split has work
# whatever the block table width, and the launch needs no device sync (CUDA-graph safe).


@triton.jit
def _split_size(context_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split for one sequence: ceil(context_len / num_splits) in whole tiles (>= 1 tile)."""
    return tl.maximum(tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # (S, H, D) final output (when not SPLIT)
    part_out_ptr,
    part_lse_ptr,  # (S, H, num_splits, D), (S, H, num_splits) fp32
    context_lens_ptr,
    block_tables_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # False: one split, write `out` directly
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    if SPLIT:
        partition = _split_size(context_len, num_splits, BLOCK_N)
        kv_start = split * partition
        if kv_start >= context_len:  # short sequence: nothing left for this split
            return
        kv_end = tl.minimum(context_len, kv_start + partition)
    else:
        kv_start = 0
        kv_end = context_len

    # The GROUP query heads that share this kv head are the rows of one matrix, so each
    # K/V tile is loaded once for the whole group (padding rows are masked).
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The single query is the last position, so every key < context_len is visible: the
    # only mask needed is the end of the context (or of this split).
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = offs_n < kv_end
        # fmt: off
        k = _load_kv_tile(
            k_cache_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE,
        )  # [BLOCK_N, BLOCK_D]
        v = _load_kv_tile(
            v_cache_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE,
        )  # [BLOCK_N, BLOCK_D]
        # fmt: on
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, m_i, l_i, acc, qk_scale, n_mask[None, :], APPLY_MASK=True
        )

    # l_i == 0 only for an empty context (e.g. a padding row): output zeros, not NaN.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]  # [BLOCK_H, BLOCK_D]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # Partial result of this split + its log-sum-exp (base 2), merged by the reduce kernel.
        row = (seq.to(tl.int64) * NUM_HEADS + heads) * num_splits + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + row, m_i + tl.log2(l_safe), mask=h_mask)
    else:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    context_lens_ptr,
    stride_os,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the decode kernel's BLOCK_N
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
    BLOCK_D: tl.constexpr,
):
    """Merge the partial softmaxes of one (sequence, query head) over its splits."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    # splits that saw at least one key (the others returned early and wrote nothing)
    num_valid = tl.cdiv(context_len, _split_size(context_len, num_splits, BLOCK_N))

    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    s_mask = offs_s < num_valid
    d_mask = offs_d < HEAD_DIM
    row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    part = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]

    # Each split's weight is its share of the total probability mass: softmax of the lse.
    lse_max = tl.where(num_valid > 0, tl.max(lse, axis=0), 0.0)  # no -inf - -inf (NaN)
    w = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)  # [BLOCK_S]
    w_sum = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(w_sum > 0, w_sum, 1.0)  # [BLOCK_D]
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def default_num_splits(
    num_seqs: int,
    kv_heads: int,
    max_context: int,
    device: torch.device,
    BLOCK_N: int = 64,
    max_splits: int = 32,
) -> int:
    """Split-K factor for decode: 1 when the batch alone fills the GPU, else enough splits
    for ~4 programs per SM (at most one split per key tile, at most max_splits)."""
    programs, sms = num_seqs * kv_heads, _num_sms(device)
    if device.type != "cuda" or programs >= 2 * sms:
        return 1
    return max(
        1, min(triton.cdiv(4 * sms, programs), triton.cdiv(max_context, BLOCK_N), max_splits)
    )


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, heads, head_dim), one query per sequence
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    context_lens: torch.Tensor,  # (num_seqs,) int32, includes the current token
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, padded with -1
    scale: float,
    num_splits: int | None = None,  # split-K factor; None = default_num_splits(...)
    BLOCK_N: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:  # (num_seqs, heads, head_dim), q.dtype
    """Attention of each sequence's single query (position context_len - 1) over its cache.

    One program per (sequence, kv head[, split]) handles all query heads of the GQA group.
    The launch reads no device values (graph-capturable); a context_len of 0 gives zeros.
    """
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    group = num_heads // kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    if num_splits is None:
        max_context = block_tables.shape[1] * page_size  # upper bound on any context_len
        num_splits = default_num_splits(num_seqs, kv_heads, max_context, q.device, BLOCK_N)
    assert num_splits >= 1

    if num_splits > 1:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused placeholders
    block_d = _block_d(head_dim)
    # fmt: off
    _paged_decode_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, context_lens, block_tables, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_splits,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        SPLIT=num_splits > 1, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        BLOCK_D=block_d, num_warps=num_warps, num_stages=num_stages,
    )
    # fmt: on
    if num_splits > 1:
        # fmt: off
        _paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, context_lens, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_N=BLOCK_N,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
        # fmt: on
    return out
