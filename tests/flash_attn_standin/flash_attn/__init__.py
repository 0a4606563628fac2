"""A plain-PyTorch stand-in for the two flash-attn functions our flash_attn backend calls.

No flash-attn wheel exists on the machines this project is developed and tested on, so
tests/test_flash_attn_backend.py puts this package on sys.path under the name `flash_attn`
and checks layers/attention_flash.py against the PyTorch reference through it. It is a
reference, not a kernel: one Python loop over the sequences, fp32 math.

It implements flash-attn 2's documented semantics, read from the docstrings of
`flash_attn/flash_attn_interface.py` and the argument checks of `csrc/flash_attn/flash_api.cpp`
(mha_varlen_fwd, mha_fwd_kvcache) in github.com/Dao-AILab/flash-attention:

* q has `nheads` heads, k/v `nheads_k`; nheads_k must divide nheads, and query head h
  reads kv head h // (nheads // nheads_k) (GQA/MQA).
* softmax_scale multiplies QK^T; None means 1 / sqrt(headdim).
* causal=True aligns the mask to the bottom-right corner: with seqlen_q queries and
  seqlen_k keys, query i sees keys j <= i + seqlen_k - seqlen_q. A query that sees no key
  (an all-zero mask row, or seqlen_k == 0) outputs zeros.
* with a block_table (int32, (batch, max_num_blocks_per_seq)) k/v are paged caches
  (num_blocks, page_block_size, nheads_k, headdim), page_block_size a multiple of 256, and
  key j of sequence b is k[block_table[b, j // page_block_size], j % page_block_size].
* q/k/v are fp16 or bf16 of one dtype; headdim <= 256 (varlen: a multiple of 8);
  cu_seqlens, cache_seqlens and block_table are int32. The output has q's dtype.

Arguments that change the result and are not implemented here (dropout, sliding windows,
softcap, ALiBi, rotary, appending new k/v, returning the LSE, ...) raise NotImplementedError."""

import torch

__version__ = "2-standin"  # not the real package: see the docstring

_DTYPES = (torch.float16, torch.bfloat16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # the real package's checks (TORCH_CHECK) raise RuntimeError


def _not_implemented(**given) -> None:
    for name, (value, default) in given.items():
        if (value is not None) if default is None else (value != default):
            raise NotImplementedError(f"flash_attn stand-in: {name}={value!r} is not implemented")


def _check_paged(cache: torch.Tensor, block_table: torch.Tensor, batch: int) -> int:
    """Checks of a paged cache (num_blocks, page_block_size, nheads_k, headdim); returns page_block_size."""
    _check(cache.dim() == 4, "paged k/v must be (num_blocks, page_block_size, nheads_k, headdim)")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(
        block_table.dim() == 2 and block_table.shape[0] == batch,
        "block_table must be (batch_size, max_num_blocks_per_seq)",
    )
    _check(cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
    return cache.shape[1]


def _gather_pages(cache: torch.Tensor, table_row: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Keys 0..seqlen-1 of one sequence: (seqlen, nheads_k, headdim). Only the pages that hold
    them are read, as the kernel does; a page id outside the cache there is an error."""
    page = cache.shape[1]
    pages = table_row[: (seqlen + page - 1) // page].long()  # (pages_used,)
    _check(
        bool(((pages >= 0) & (pages < cache.shape[0])).all()),
        f"block_table points outside the cache: {pages.tolist()}",
    )
    return cache[pages].reshape(-1, *cache.shape[2:])[:seqlen]


def _attend(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """One sequence. q: (seqlen_q, nheads, d); k, v: (seqlen_k, nheads_k, d) -> (seqlen_q, nheads, d), q.dtype."""
    seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_k = k.shape[0], k.shape[1]
    group = nheads // nheads_k
    k = k.float().repeat_interleave(
        group, dim=1
    )  # (seqlen_k, nheads, d): kv head h // group -> query head h
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # (nheads, seqlen_q, seqlen_k)
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)  # (seqlen_q, seqlen_k)
    if causal:  # bottom-right alignment: query i sees keys j <= i + seqlen_k - seqlen_q
        i = torch.arange(seqlen_q, device=q.device)[:, None]
        j = torch.arange(seqlen_k, device=q.device)[None, :]
        keep = j <= i + seqlen_k - seqlen_q
    probs = torch.softmax(
        scores.masked_fill(~keep, float("-inf")), dim=-1
    )  # (nheads, seqlen_q, seqlen_k)
    probs = torch.where(
        keep.any(dim=1)[None, :, None], probs, 0.0
    )  # a query that sees no key outputs 0
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _check_qkv(q, k, v, nheads_k: int, varlen: bool) -> None:
    _check(q.dtype in _DTYPES, "FlashAttention only support fp16 and bf16 data type")
    _check(
        k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype"
    )
    _check(k.stride(-1) == 1 and v.stride(-1) == 1, "k/v must have contiguous last dimension")
    _check(
        k.shape == v.shape and k.shape[-1] == q.shape[-1],
        "k and v must have the same shape, with q's headdim",
    )
    _check(
        q.shape[-2] % nheads_k == 0,
        "Number of heads in key/value must divide number of heads in query",
    )
    _check(q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(not varlen or q.shape[-1] % 8 == 0, "head_size must be a multiple of 8")


def flash_attn_varlen_func(
    q,  # (total_q, nheads, headdim): the sequences' queries packed
    k,  # (total_k, nheads_k, headdim), or (num_blocks, page_block_size, nheads_k, headdim) with a block_table
    v,  # like k
    cu_seqlens_q,  # (batch+1,) int32: sequence b's queries are q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]
    cu_seqlens_k,  # (batch+1,) int32: sequence b has cu_seqlens_k[b+1] - cu_seqlens_k[b] keys
    max_seqlen_q,  # int: the longest query run
    max_seqlen_k,  # int: the longest key run
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,  # backward only; the forward pass is always deterministic
    return_attn_probs=False,
    block_table=None,  # (batch, max_num_blocks_per_seq) int32, or None
):  # -> (total_q, nheads, headdim), q.dtype
    _not_implemented(
        dropout_p=(dropout_p, 0.0),
        window_size=(tuple(window_size), (-1, -1)),
        softcap=(softcap, 0.0),
        alibi_slopes=(alibi_slopes, None),
        return_attn_probs=(return_attn_probs, False),
    )
    paged = block_table is not None
    _check(
        cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32,
        "cu_seqlens_q/k must have dtype int32",
    )
    batch = cu_seqlens_q.numel() - 1
    _check(
        batch > 0 and cu_seqlens_k.numel() == batch + 1,
        "cu_seqlens_q and cu_seqlens_k must be (batch_size + 1,)",
    )
    _check_qkv(q, k, v, k.shape[-2], varlen=True)
    if paged:
        _check_paged(k, block_table, batch)
    else:
        _check(k.dim() == 3, "k/v must be (total_k, nheads_k, headdim) without a block_table")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros_like(q)  # (total_q, nheads, headdim)
    for b in range(batch):
        seqlen_q, seqlen_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        _check(
            seqlen_q <= max_seqlen_q and seqlen_k <= max_seqlen_k,
            f"sequence {b}: lengths exceed max_seqlen_q/k",
        )
        if seqlen_q == 0:
            continue
        if paged:
            kb, vb = (
                _gather_pages(k, block_table[b], seqlen_k),
                _gather_pages(v, block_table[b], seqlen_k),
            )
        else:
            kb, vb = (
                k[cu_k[b] : cu_k[b + 1]],
                v[cu_k[b] : cu_k[b + 1]],
            )  # (seqlen_k, nheads_k, headdim)
        out[cu_q[b] : cu_q[b + 1]] = _attend(q[cu_q[b] : cu_q[b + 1]], kb, vb, scale, causal)
    return out


def flash_attn_with_kvcache(
    q,  # (batch, seqlen_q, nheads, headdim)
    k_cache,  # (batch_cache, seqlen_cache, nheads_k, headdim), or (num_blocks, page_block_size, nheads_k, headdim) with a block_table
    v_cache,  # like k_cache
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,  # int or (batch,) int32: valid tokens per sequence; None: the whole cache
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,  # (batch, max_num_blocks_per_seq) int32, or None
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,  # only used with rotary_cos/sin
    alibi_slopes=None,
    num_splits=0,  # a performance knob: does not change the result
    return_softmax_lse=False,
):  # -> (batch, seqlen_q, nheads, headdim), q.dtype
    _not_implemented(
        k=(k, None),
        v=(v, None),
        rotary_cos=(rotary_cos, None),
        rotary_sin=(rotary_sin, None),
        cache_batch_idx=(cache_batch_idx, None),
        cache_leftpad=(cache_leftpad, None),
        window_size=(tuple(window_size), (-1, -1)),
        softcap=(softcap, 0.0),
        alibi_slopes=(alibi_slopes, None),
        return_softmax_lse=(return_softmax_lse, False),
    )
    _check(
        q.dim() == 4 and k_cache.dim() == 4,
        "q must be (batch, seqlen_q, nheads, headdim) and k_cache 4-d",
    )
    batch = q.shape[0]
    _check_qkv(q, k_cache, v_cache, k_cache.shape[2], varlen=False)
    if block_table is not None:
        page = _check_paged(k_cache, block_table, batch)
        capacity = block_table.shape[1] * page
    else:
        _check(
            k_cache.shape[0] == batch,
            "without a block_table, k_cache must be (batch_size, seqlen_cache, nheads_k, headdim)",
        )
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    _check(
        cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (batch,),
        "cache_seqlens must be (batch_size,) int32",
    )
    lens = cache_seqlens.tolist()
    _check(
        max(lens) <= capacity,
        f"max(cache_seqlens) = {max(lens)} exceeds the cache's capacity {capacity}",
    )
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros_like(q)  # (batch, seqlen_q, nheads, headdim)
    for b, seqlen_k in enumerate(lens):
        if block_table is not None:
            kb, vb = (
                _gather_pages(k_cache, block_table[b], seqlen_k),
                _gather_pages(v_cache, block_table[b], seqlen_k),
            )
        else:
            kb, vb = k_cache[b, :seqlen_k], v_cache[b, :seqlen_k]  # (seqlen_k, nheads_k, headdim)
        out[b] = _attend(q[b], kb, vb, scale, causal)
    return out
