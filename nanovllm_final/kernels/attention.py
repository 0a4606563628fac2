"""Paged attention in Triton: our own kernels for the KV-cache store, prefill and decode.

The reference is layers/attention_torch.py (the torch backend): the same three functions,
the same semantics (tests/test_kernels.py and tests/test_kv_fp8.py check these against it):

    k_cache, v_cache: (num_blocks, block_size, kv_heads, head_dim)
    slot = block_id * block_size + offset_in_block

Key position p of sequence i lives in block ``block_tables[i, p // block_size]`` at
offset ``p % block_size``, so any block size works (1, 3, 16, 256, ...).

Kernels
-------
* ``store_kvcache``          one program per token: copy its K/V rows into the cache.
* ``paged_prefill_attention`` FlashAttention-style: one program per (query head, query
                             tile of any sequence); loops over key tiles, online softmax in
                             fp32. The grid is sized from the shapes alone (tokens, sequences),
                             so a step with prompts can be captured in a CUDA graph too.
* ``paged_decode_attention`` one program per (sequence, kv head[, split]): all query heads
                             of the GQA group share each K/V tile that is loaded. Optional
                             split-K over the context, merged by the last split to finish, so
                             that a few long sequences still fill the GPU; it can also store the
                             new tokens' K/V itself (``new_kv``): a decode step is one launch.
                             It also takes a few queries per sequence (``cu_seqlens_q``): a
                             verify step's 1 + k, each row masked causally.

Conventions: tensors' last dim must be contiguous; every accumulation is fp32; fp32, fp16
and bf16 inputs are supported; head_dim need not be a power of two (BLOCK_D pads it and
masks). To debug on a CPU, set ``TRITON_INTERPRET=1`` before importing triton.

An fp8 cache (``kv_cache_dtype="fp8"``; attention.py states the contract): the store
kernel quantizes; the scales apply once per row (``_kv_scales``: K's in the softmax scale, V's
on the output), read by pointer, so a captured graph stays valid. Prefill and decode read the
e4m3 tiles in one of two ways (``_fp8_launch``; ``dispatch.fp8_dot`` picks):

* fp8 tensor-core products (fp16/bf16 q on compute capability 8.9+): q is quantized to e4m3
  once per program (``_quantize_q``: by default each query head's amax / 448 at this step, or a
  static per-tensor ``q_scale``), the scores are e4m3 q by the e4m3 K tile as loaded, fp32
  accumulate, times q's and K's scales; P·V is e4m3 P (in [0, 1] after the max is subtracted,
  times 448) by the e4m3 V tile (``PV_FP8``), or fp16 P by V widened to fp16. On Hopper the
  decode kernel's GQA group is padded to a warpgroup's 64 rows (``_group_rows``).
* widening (elsewhere, and the reference): each tile is widened in registers (to fp16 under
  bf16, ``_widen_to``), exactly, and multiplied in q's precision.
"""

import os

import torch
import triton
import triton.language as tl

from . import dispatch, tuning
from .common import SplitCounters
from .launch import pdl_args, wait_for_prior_kernel
from .norm_rope import rope_rows

name = "triton"
capturable = True  # no launch reads a device value
capturable_prefill = True  # nor does the prefill launch: steps with prompts can be captured too
fuses_rope = True  # the decode kernel and a prompt step's store apply RoPE (and q/k norms)
decode_queries = 16  # the decode kernel takes up to 16 queries per sequence (a verify step's 1 + k)

# exp(x) == exp2(x * log2(e)): exp2 is the cheaper instruction on GPUs, so the kernels
# fold log2(e) into the softmax scale once and use exp2 everywhere.
LOG2E = 1.4426950408889634


FP8_MAX = tl.constexpr(448.0)  # the largest float8 e4m3 value
# With fp8 tensor-core products (dispatch.fp8_dot), per kernel: P·V as e4m3 P (times 448) by the
# cache's e4m3 V (True), or V widened to fp16 by fp16 P (False). A launch's `pv_fp8` overrides it.
# False until measured otherwise (benchmarks/fp8_attention_bench.py): P·V's second operand must be
# K-major (keys contiguous) in e4m3 on Hopper, and V's rows are head_dim-contiguous, so Triton
# transposes V in registers before its shared-memory store and gives up pipelining its load; an
# fp16 operand the warpgroup MMA reads either way.
PV_FP8 = {"decode": False, "prefill": False}
_INTERPRETED = (
    os.environ.get("TRITON_INTERPRET") == "1"
)  # the interpreter's fp8 cast needs help (_e4m3)


def _fp8_args(k_cache: torch.Tensor, k_scale, v_scale) -> tuple:
    """(k_scale, v_scale, FP8) for a launch: an fp8 cache needs its scales; otherwise any
    pointer stands in (never read)."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert not fp8 or (k_scale is not None and v_scale is not None), (
        "an fp8 KV cache needs k_scale and v_scale"
    )
    return (k_scale, v_scale, True) if fp8 else (k_cache, k_cache, False)


def _fp8_launch(
    kernel: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    k_scale,
    v_scale,
    fp8_dot: bool | None,
    pv_fp8: bool | None,
    q_scale: torch.Tensor | None,
) -> tuple[tuple, dict]:
    """((k_scale, v_scale, q_scale) pointers, the FP8 constexprs) of a launch of `kernel` ("decode"
    or "prefill"). FP8_DOT: the scores are e4m3 q by the fp8 cache's e4m3 K on tensor cores (fp8_dot;
    None: where dispatch.fp8_dot says); PV_FP8: so is P·V (pv_fp8; None: PV_FP8[kernel]); Q_DYNAMIC:
    q's scale is each row's own (q_scale None), else the static per-tensor q_scale, (1,) float32."""
    k_scale, v_scale, fp8 = _fp8_args(k_cache, k_scale, v_scale)
    dot = fp8 and (dispatch.fp8_dot(q) if fp8_dot is None else fp8_dot)
    assert q_scale is None or (q_scale.numel() == 1 and q_scale.dtype == torch.float32), (
        "q_scale: (1,) float32"
    )
    flags = {
        "FP8": fp8,
        "FP8_DOT": dot,
        "PV_FP8": dot and (PV_FP8[kernel] if pv_fp8 is None else pv_fp8),
        "Q_DYNAMIC": q_scale is None,
        "ROUND": _INTERPRETED,
    }
    return (k_scale, v_scale, k_scale if q_scale is None else q_scale), flags


def _block_d(head_dim: int, flags: dict, block_n: int) -> int:
    """head_dim padded to a power of two (masked), at least tl.dot's least K: 16, and 32 for e4m3
    operands (an fp8 tensor-core product takes 32 of K at a time), so does BLOCK_N, P·V's K, there."""
    assert not flags["PV_FP8"] or block_n >= 32, f"P·V in e4m3 needs BLOCK_N >= 32, got {block_n}"
    return max(32 if flags["FP8_DOT"] else 16, triton.next_power_of_2(head_dim))


# ---------------------------------------------------------------------------------------
# KV-cache store
# ---------------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest float8 e4m3 value (ties to even), still fp32,
    so that the cast after it is exact: the same rounding as torch's cast on every backend
    (the Triton interpreter's own fp32 -> fp8 cast loses a rounding carry into the exponent)."""
    bits = x.to(tl.int32, bitcast=True)
    # normal range (|x| >= 2**-6): keep 3 of the 23 mantissa bits; a carry moves into the exponent
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2**-9; adding 1.5 * 2**14 (ulp 2**-9) rounds to them
    subnormal = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(bits < 0, -subnormal, subnormal)  # the sign, also of a zero
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _to_e4m3(x, scale):
    """What an fp8 cache stores of x: clamp(x / scale, +-448) rounded to e4m3 (still fp32)."""
    return _round_to_e4m3(tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX))


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,  # (N, KVH, D), strides below, last dim contiguous
    k_cache_ptr,
    v_cache_ptr,  # contiguous (num_blocks * block_size, KVH, D) slots
    slot_mapping_ptr,  # (N,)
    k_scale_ptr,
    v_scale_ptr,  # (KVH,) fp32, read when FP8
    q_ptr,  # with ROPE: (N, QH, D) unrotated, strides below; q_out_ptr (N, QH, D) contiguous
    q_out_ptr,
    pos_ptr,  # with ROPE: (N,) positions, the cos/sin tables (positions, D), the norms' weights
    cos_ptr,
    sin_ptr,
    q_w_ptr,
    k_w_ptr,
    eps,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qt,
    stride_qh,
    stride_cos,
    KVH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the cache is float8 e4m3: store x / scale
    QH: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    ROPE: tl.constexpr,  # rotate q (into q_out) and the key (before it is stored) for pos_ptr[t]
    HAS_NORM: tl.constexpr,  # with ROPE: Qwen3's q/k RMSNorm first
    PDL: tl.constexpr,  # launched with programmatic dependent launch (launch.py)
):
    wait_for_prior_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_ok = offs_h < KVH
    mask = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    if ROPE:  # every token's q (a padding row's too: the attention reads it)
        pos = tl.load(pos_ptr + token).to(tl.int64)
        offs_qh = tl.arange(0, BLOCK_QH)  # [BLOCK_QH]
        # fmt: off
        q = rope_rows(
            q_ptr + token * stride_qt, offs_qh * stride_qh, offs_qh < QH, pos, cos_ptr, sin_ptr,
            stride_cos, q_w_ptr, eps, offs_d, HEAD_DIM, HAS_NORM,
        )  # [BLOCK_QH, BLOCK_D]
        # fmt: on
        tl.store(
            q_out_ptr + (token * QH + offs_qh[:, None]) * HEAD_DIM + offs_d[None, :],
            q.to(q_out_ptr.dtype.element_ty),
            mask=(offs_qh[:, None] < QH) & (offs_d[None, :] < HEAD_DIM),
        )
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int64: big caches overflow int32
    if slot < 0:  # -1 marks a token that must not be stored (e.g. padding)
        return
    if ROPE:  # [BLOCK_H, BLOCK_D] fp32 holding the values the rotary layer would write
        # fmt: off
        k = rope_rows(
            key_ptr + token * stride_kt, offs_h * stride_kh, h_ok, pos, cos_ptr, sin_ptr,
            stride_cos, k_w_ptr, eps, offs_d, HEAD_DIM, HAS_NORM,
        )
        # fmt: on
    else:
        k = tl.load(
            key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
        )
    v = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    if FP8:
        k = _to_e4m3(
            k, tl.load(k_scale_ptr + offs_h, mask=h_ok, other=1.0)[:, None]
        )  # scales [BLOCK_H, 1]
        v = _to_e4m3(v, tl.load(v_scale_ptr + offs_h, mask=h_ok, other=1.0)[:, None])
    dst = slot * (KVH * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,  # (N, kv_heads, head_dim)
    value: torch.Tensor,  # (N, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim), contiguous
    slot_mapping: torch.Tensor,  # (N,) int32/int64; -1 = skip this token
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32, for an fp8 cache
    v_scale: torch.Tensor | None = None,
    *,
    q: torch.Tensor | None = None,  # (N, heads, head_dim), with rope
    rope: tuple | None = None,  # (positions, cos, sin, q_norm weight | None, k_norm's, eps)
) -> torch.Tensor | None:
    """Write token t's key/value into cache slot slot_mapping[t] (in place), quantized for an fp8
    cache. With `rope` (and q): q and the key come as the qkv projection gives them; the key is
    rotated (after its norm) as the rotary layer would before it is stored, and q's rotated copy
    (N, heads, head_dim) is returned: a prompt step's rotary embedding and store in one launch."""
    num_tokens, kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "last dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[2:] == (kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert (q is None) == (rope is None), "q is rotated with rope: both or neither"
    q_in = key if q is None else q  # unread without rope
    q_out = None if q is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    k_scale, v_scale, fp8 = _fp8_args(k_cache, k_scale, v_scale)
    assert q is None or (q.shape[0] == num_tokens and q.shape[2] == head_dim and q.stride(-1) == 1)
    positions, cos, sin, q_w, k_w, eps = _rope_args(q_in, (key, value, slot_mapping), rope)
    # fmt: off
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, q_in,
        q_in if q_out is None else q_out, positions, cos, sin, q_in if q_w is None else q_w,
        q_in if k_w is None else k_w, eps, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), q_in.stride(0), q_in.stride(1), cos.stride(0), KVH=kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8, QH=q_in.shape[1],
        BLOCK_QH=triton.next_power_of_2(q_in.shape[1]), ROPE=rope is not None,
        HAS_NORM=q_w is not None, **pdl_args(key.device),
    )
    # fmt: on
    return q_out


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
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
):
    """Rows offs_n (key positions of one sequence) of one kv head: [BLOCK_N, BLOCK_D], in the
    cache's dtype (_online_softmax_step makes the products' operands of it). An fp8 cache's
    scale, one per kv head, is the caller's (_kv_scales): K's folds into the softmax scale, V's
    into the output, one multiply per row instead of one per element. MASK_N: rows outside n_mask
    read as 0 (without it, every row must be a valid position); MASK_D: so do lanes outside d_mask
    (head_dim < BLOCK_D)."""
    # Logical position p -> (physical block, offset in block). PAGE_SIZE is a constexpr
    # so that powers of two compile to shifts/masks.
    if MASK_N:
        block_ids = tl.load(block_table_row_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    else:
        block_ids = tl.load(block_table_row_ptr + offs_n // PAGE_SIZE)
    row = (
        block_ids.to(tl.int64) * stride_cb + (offs_n % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    )
    ptrs = cache_ptr + row[:, None] + offs_d[None, :]
    if MASK_N:
        tile = tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif MASK_D:
        tile = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _widen_to(q, FP8: tl.constexpr):
    """q in the dtype the K/V tiles are widened to: with an fp8 cache and bf16 q, fp16, as e4m3
    widens to fp16 in one packed instruction per two values and to bf16 only through fp16, one
    instruction more per value (every e4m3 value, and every bf16 value of q's range, is exact in
    fp16); otherwise q's own dtype."""
    if FP8 and q.dtype == tl.bfloat16:
        return q.to(tl.float16)
    else:
        return q


@triton.jit
def _e4m3(x, ROUND: tl.constexpr):
    """fp32 x (|x| <= 448) as float8 e4m3, rounded to the nearest (ties to even), as the GPU's
    cast rounds; the Triton interpreter's cast loses the carry into the exponent, so there
    (ROUND) _round_to_e4m3 rounds first."""
    if ROUND:
        x = _round_to_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_q(q, q_scale_ptr, Q_DYNAMIC: tl.constexpr, ROUND: tl.constexpr):
    """q [ROWS, BLOCK_D] as e4m3 and each row's scale [ROWS] (q ~ q8 * scale). Q_DYNAMIC: a row's
    own amax / 448, this step (a row is one query head of one token: nothing clips, nothing to
    calibrate; a zero row, padding, stays 0); else the static per-tensor scale at q_scale_ptr
    (values beyond +-448 * scale clip)."""
    q = q.to(tl.float32)
    if Q_DYNAMIC:
        scale = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30) / FP8_MAX  # [ROWS]
    else:
        scale = tl.full([q.shape[0]], 1.0, tl.float32) * tl.load(q_scale_ptr)  # [ROWS]
    return _e4m3(tl.clamp(q / scale[:, None], -FP8_MAX, FP8_MAX), ROUND), scale


@triton.jit
def _q_operand(
    q,
    qk_scale,
    k_s,
    q_scale_ptr,
    FP8: tl.constexpr,
    FP8_DOT: tl.constexpr,
    Q_DYNAMIC: tl.constexpr,
    ROUND: tl.constexpr,
):
    """(q as the score product's operand [ROWS, BLOCK_D], the scores' scale: a scalar or [ROWS, 1]).
    K's scale folds into the softmax scale: q . (k * k_s) == (q . k) * k_s. FP8_DOT: q in e4m3
    (_quantize_q), its rows' scales folded in as well, for e4m3 x e4m3 products with the fp8
    cache's K tiles as they are; else q as K's tiles are widened (_widen_to)."""
    qk_scale = qk_scale * k_s
    if FP8_DOT:
        q8, q_s = _quantize_q(q, q_scale_ptr, Q_DYNAMIC, ROUND)
        return q8, qk_scale * q_s[:, None]
    else:
        return _widen_to(q, FP8), qk_scale


@triton.jit
def _dot(a, b):
    """a @ b, fp32 accumulate; exact fp32 products for fp32 operands (input_precision="ieee")."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8: tl.constexpr):
    """An fp8 cache's dequantization scales of one kv head (K's, V's); 1 otherwise."""
    if FP8:
        return tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)
    else:
        return 1.0, 1.0


@triton.jit
def _online_softmax_step(
    q,
    k,
    v,
    m_i,
    l_i,
    acc,
    qk_scale,
    mask,
    APPLY_MASK: tl.constexpr,
    PV_FP8: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Fold one key tile into the running softmax state of a block of query rows.

    q [ROWS, BLOCK_D] (_q_operand's), k/v [BLOCK_N, BLOCK_D] as loaded, mask [ROWS, BLOCK_N]
    (True = may attend); m_i [ROWS] running max (base-2 logits), l_i [ROWS] running sum, acc
    [ROWS, BLOCK_D]. Every row must see at least one key in its first tile, so m_i never stays
    -inf. K is made q's dtype (a no-op for e4m3 q on an fp8 cache, else widened in registers,
    exactly: every e4m3 value is an fp16 and fp32 value). PV_FP8 (e4m3 q only): P, in [0, 1]
    after the max is subtracted, times 448 in e4m3 by V's e4m3 tile (acc is then 448 times too
    large: the caller divides); else V is widened to fp16 under e4m3 q, to q's dtype otherwise.
    """
    s = _dot(q, tl.trans(k.to(q.dtype))) * qk_scale  # [ROWS, BLOCK_N]
    if APPLY_MASK:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [ROWS]
    alpha = tl.exp2(m_i - m_new)  # rescales the old state to the new max
    p = tl.exp2(s - m_new[:, None])  # [ROWS, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if PV_FP8:
        pv = tl.dot(_e4m3(p * FP8_MAX, ROUND), v)  # [ROWS, BLOCK_D]
    else:
        v = v.to(tl.float16) if q.dtype == tl.float8e4nv else v.to(q.dtype)
        pv = _dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------
# Prefill (general case): packed queries, paged keys, causal
# ---------------------------------------------------------------------------------------


@triton.jit
def _prefill_tile(cu_seqlens_q_ptr, num_seqs, index, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, query tile) of the index-th tile counted from the end of the list of every
    sequence's tiles in order; (-1, 0) past the last one."""
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S] sequences
    s_ok = offs_s < num_seqs
    starts = tl.load(cu_seqlens_q_ptr + offs_s, mask=s_ok, other=0)
    ends = tl.load(cu_seqlens_q_ptr + offs_s + 1, mask=s_ok, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # [BLOCK_S] query tiles of each sequence
    tiles_end = tl.cumsum(tiles, 0)  # [BLOCK_S] where each sequence's tiles end in the list
    flat = tl.sum(tiles, 0) - 1 - index  # position in the list, counted from its start
    seq = tl.sum(
        (tiles_end <= flat).to(tl.int32), 0
    )  # the sequences whose tiles end at or before it
    first = tl.sum(
        tl.where(offs_s == seq, tiles_end - tiles, 0), 0
    )  # the sequence's first tile in the list
    if flat < 0:
        seq = -1
    return seq, flat - first


# The sequence count and the block-table width change from step to step: not specialized on
# (Triton would compile a variant per divisibility class), so that the variants compiled while
# the CUDA graphs are captured (one per BLOCK_S) serve every eager step too.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _paged_prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,  # (KVH,) fp32, read when FP8
    q_scale_ptr,  # (1,) fp32: q's static scale, read when FP8_DOT and not Q_DYNAMIC
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,  # cache strides: block, slot in block, kv head
    stride_bt,  # block table row stride
    num_seqs,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_seqs, padded to a power of two (at least 16)
    FP8: tl.constexpr,  # the cache is float8 e4m3 (see _load_kv_tile)
    FP8_DOT: tl.constexpr,
    PV_FP8: tl.constexpr,
    Q_DYNAMIC: tl.constexpr,
    ROUND: tl.constexpr,  # see _fp8_launch
    PDL: tl.constexpr,  # launched with programmatic dependent launch (launch.py)
):
    wait_for_prior_kernel(PDL)
    # Query heads are the fast grid axis: the heads of one tile start together and share its
    # keys in L2. The second axis counts the tiles of every sequence backwards, so the last
    # tiles of the last sequences (the newest prompt, the most keys under the causal mask)
    # start first: better load balance. The grid may hold more tiles than there are (it is
    # sized from the shapes alone); those programs return at once.
    head = tl.program_id(0)
    kv_head = head // GROUP
    seq, tile_m = _prefill_tile(cu_seqlens_q_ptr, num_seqs, tl.program_id(1), BLOCK_M, BLOCK_S)
    if seq < 0:
        return
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
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
    k_s, v_s = _kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8)
    q, qk_scale = _q_operand(q, qk_scale, k_s, q_scale_ptr, FP8, FP8_DOT, Q_DYNAMIC, ROUND)

    # Phase 1: tiles below the diagonal (the cached prefix, earlier query tiles): no mask.
    for start_n in range(0, full_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        # fmt: off
        k = _load_kv_tile(
            k_cache_ptr, bt_row, offs_n, all_n, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE, True, True,
        )  # [BLOCK_N, BLOCK_D]
        v = _load_kv_tile(
            v_cache_ptr, bt_row, offs_n, all_n, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE, True, True,
        )  # [BLOCK_N, BLOCK_D]
        # fmt: on
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, m_i, l_i, acc, qk_scale, None, False, PV_FP8, ROUND
        )

    # Phase 2: tiles on the diagonal: mask keys after each query (and past the context).
    for start_n in range(full_end, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        # fmt: off
        k = _load_kv_tile(
            k_cache_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE, True, True,
        )
        v = _load_kv_tile(
            v_cache_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE, True, True,
        )
        # fmt: on
        causal = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, m_i, l_i, acc, qk_scale, causal, True, PV_FP8, ROUND
        )

    if PV_FP8:
        v_s = v_s / FP8_MAX  # P was scaled by FP8_MAX
    out = acc * (v_s / l_i)[:, None]  # sum p * (v * v_s) / l
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
    max_seqlen_q: int,  # longest q_len in the batch (the API's; the grid needs only the shapes)
    BLOCK_M: int | None = None,  # this and the three below, None: the device's tuning
    BLOCK_N: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32, for an fp8 cache
    v_scale: torch.Tensor | None = None,
    fp8_dot: bool | None = None,  # e4m3 tensor-core products (_fp8_launch); None: the device's
    pv_fp8: bool | None = None,
    q_scale: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, ...] | None = None,  # (k, v, slot_mapping) of the new tokens
    rope: tuple | None = None,  # (positions, cos, sin, q_norm weight | None, k_norm's, eps)
) -> torch.Tensor:  # (N, heads, head_dim), q.dtype
    """Causal attention of packed queries over a paged cache (see attention_torch.py).

    The new tokens' K/V must be in the cache: already stored, or given as `new_kv`, which
    store_kvcache writes first; with `rope`, q and new_kv's k come unrotated, and that same launch
    rotates them. Query j of sequence i is at position context_lens[i] - q_len_i + j.
    """
    if new_kv is not None:
        k, v, slot_mapping = new_kv
        rotated = store_kvcache(
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k_scale,
            v_scale,
            q=None if rope is None else q,
            rope=rope,
        )
        q = q if rope is None else rotated
    else:
        assert rope is None, "rope rotates the new K as it stores it: it needs new_kv"
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    assert num_heads % kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0 or max_seqlen_q == 0:
        return out
    tiles = tuning.for_device(q.device).prefill(head_dim)
    BLOCK_M, BLOCK_N = BLOCK_M or tiles["BLOCK_M"], BLOCK_N or tiles["BLOCK_N"]
    num_warps, num_stages = num_warps or tiles["num_warps"], num_stages or tiles["num_stages"]
    # at least the tiles of any split of num_tokens into num_seqs
    max_tiles = triton.cdiv(num_tokens, BLOCK_M) + num_seqs
    grid = (num_heads, max_tiles)
    scales, flags = _fp8_launch("prefill", q, k_cache, k_scale, v_scale, fp8_dot, pv_fp8, q_scale)
    # a line per group of arguments: pointers, strides, compile-time flags
    # fmt: off
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, *scales, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_seqs,
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=_block_d(head_dim, flags, BLOCK_N),
        BLOCK_S=max(16, triton.next_power_of_2(num_seqs)), **flags,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device),
    )
    # fmt: on
    return out


# ---------------------------------------------------------------------------------------
# Decode: one query per sequence, at position context_len - 1
# ---------------------------------------------------------------------------------------
#
# Split-K ("flash decoding"): with few sequences there are too few (sequence, kv head)
# programs to fill the GPU, so each context is cut into num_splits partitions handled by
# separate programs, each writing a partial result + its log-sum-exp. The last of a
# (sequence, kv head)'s splits to finish merges them (it counts the finished splits with an
# atomic), so split-K costs no second launch. num_splits depends only on the batch shape;
# each sequence's partition size is computed *inside* the kernel from its own context_len,
# so every split has work whatever the block table width, and the launch needs no device
# sync (CUDA-graph safe).
#
# The new token's K/V (`new_kv`): the program that holds a sequence's last key writes them
# into the cache before its loop reads them back (store_kvcache's job), so a decode step needs
# no store launch. With `rope` as well, q and the new K come as the qkv projection gives them:
# the kernel applies Qwen3's q/k norms (when their weights are given) and the rotary embedding
# itself, as the rotary layer would: the whole of a decode step's attention is one launch.


@triton.jit
def _split_range(context_len, q_len, split, num_splits, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """(kv_start, kv_end, num_valid): the keys of one sequence this split attends to, and how many
    splits see at least one key. The splits cut the keys every query sees, the first
    context_len - q_len + 1, into ceil(that / num_splits) keys each in whole tiles (>= 1 tile),
    from the sequence's own context: every split has work whatever the block-table width. The
    last of them also takes the keys after those (the later queries' own), so every split's
    first key is seen by all queries, and the new tokens' keys all fall in the last split.
    Empty (kv_start >= kv_end) for a split past a short context, or a context of 0."""
    if SPLIT:
        shared = context_len - q_len + 1  # keys before the first query's own, and it
        partition = tl.maximum(tl.cdiv(tl.cdiv(shared, num_splits), BLOCK_N), 1) * BLOCK_N
        kv_start = split * partition
        num_valid = tl.cdiv(shared, partition)
        kv_end = tl.minimum(shared, kv_start + partition)
        if split == num_valid - 1:
            kv_end = context_len
        return kv_start, kv_end, num_valid
    else:
        return 0, context_len, 1


@triton.jit
def _store_new_kv(
    new_k_ptr,
    new_v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    q_start,
    q_len,
    kv_head,
    k_s,
    v_s,
    offs_d,
    d_mask,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    k_w_ptr,
    eps,
    stride_nk,
    stride_nkh,
    stride_nv,
    stride_nvh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """A sequence's q_len new tokens (from token q_start on): their K/V of one kv head into their
    cache slots (slot_ptr[token]; -1: none), as store_kvcache writes them; with ROPE, K is rotated
    (after its norm) for its position first, as the rotary layer would. Rows are a [BLOCK_Q,
    BLOCK_D] tile, the shape rope_rows works on. Ends with a barrier: every thread's store is done
    before any thread reads the tile back."""
    offs_q = tl.arange(0, BLOCK_Q)  # [BLOCK_Q]
    tokens = (q_start + offs_q).to(tl.int64)
    slots = tl.load(slot_ptr + tokens, mask=offs_q < q_len, other=-1).to(tl.int64)  # [BLOCK_Q]
    rows_ok = slots >= 0
    mask = rows_ok[:, None] & d_mask[None, :]
    k_rows = tokens * stride_nk + kv_head * stride_nkh  # [BLOCK_Q]
    if ROPE:
        pos = tl.load(pos_ptr + tokens, mask=rows_ok, other=0).to(tl.int64)  # [BLOCK_Q]
        # fmt: off
        k = rope_rows(
            new_k_ptr, k_rows, rows_ok, pos, cos_ptr, sin_ptr, stride_cos, k_w_ptr, eps, offs_d,
            HEAD_DIM, HAS_NORM,
        )
        # fmt: on
    else:
        k = tl.load(new_k_ptr + k_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v_rows = tokens * stride_nv + kv_head * stride_nvh
    v = tl.load(new_v_ptr + v_rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if FP8:
        k, v = _to_e4m3(k, k_s), _to_e4m3(v, v_s)
    dst = (slots // PAGE_SIZE) * stride_cb + (slots % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    dst = dst[:, None] + offs_d[None, :]  # [BLOCK_Q, BLOCK_D]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()


@triton.jit
def _group_rows_of(q_start, q_len, kv_head, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """The rows of a decode program's products: row r is query head r % GROUP of the kv head's
    group at the sequence's (r // GROUP)-th new token. (tokens, heads, rows_ok), each [ROWS]."""
    offs = tl.arange(0, ROWS)
    return q_start + offs // GROUP, kv_head * GROUP + offs % GROUP, offs < GROUP * q_len


@triton.jit
def _load_group_q(
    q_ptr,
    q_start,
    q_len,
    kv_head,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    q_w_ptr,
    eps,
    offs_d,
    stride_qs,
    stride_qh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The GROUP query heads of one kv head at each of the sequence's q_len new tokens as the rows
    of a [BLOCK_H, BLOCK_D] matrix (_group_rows_of's order; padding rows 0), in q's dtype; with
    ROPE rotated first (after the q norm), each for its token's position.
    The rotation works element by element, so it runs on the GROUP * q_len real rows only
    (BLOCK_G of them), which are then spread over the BLOCK_H rows that tl.dot needs."""
    if ROPE:
        tokens, heads, rows_ok = _group_rows_of(q_start, q_len, kv_head, BLOCK_G, GROUP)
        tokens = tokens.to(tl.int64)  # [BLOCK_G]
        pos = tl.load(pos_ptr + tokens, mask=rows_ok, other=0).to(tl.int64)
        # fmt: off
        q = rope_rows(
            q_ptr, tokens * stride_qs + heads * stride_qh, rows_ok, pos, cos_ptr, sin_ptr,
            stride_cos, q_w_ptr, eps, offs_d, HEAD_DIM, HAS_NORM,
        )  # [BLOCK_G, BLOCK_D]
        # fmt: on
        q = tl.reshape(
            tl.broadcast_to(q[None, :, :], (BLOCK_H // BLOCK_G, BLOCK_G, BLOCK_D)),
            (BLOCK_H, BLOCK_D),
        )
        _, _, h_mask = _group_rows_of(q_start, q_len, kv_head, BLOCK_H, GROUP)
        q = tl.where(h_mask[:, None], q, 0.0).to(q_ptr.dtype.element_ty)  # [BLOCK_H, BLOCK_D]
    else:
        tokens, heads, h_mask = _group_rows_of(q_start, q_len, kv_head, BLOCK_H, GROUP)
        rows = tokens.to(tl.int64) * stride_qs + heads * stride_qh  # [BLOCK_H]
        mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return q


@triton.jit
def _merge_splits(
    part_out_ptr,
    part_lse_ptr,
    first_row,
    num_valid,
    num_splits,
    offs_d,
    mask,
    h_mask,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The GROUP heads' outputs from their num_valid partial softmaxes: each split weighs by its
    share of the probability mass (softmax of the log-sum-exps), merged online. first_row
    [BLOCK_H]: each head's row of split 0. Loads bypass L1 (.cg): other programs wrote them."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # the largest lse so far
    w = tl.zeros([BLOCK_H], tl.float32)  # sum of exp2(lse - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for split in range(0, num_valid):
        row = first_row + split  # [BLOCK_H]
        lse = tl.load(part_lse_ptr + row, mask=h_mask, other=0.0, cache_modifier=".cg")  # [BLOCK_H]
        part = tl.load(
            part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask,
            other=0.0,
            cache_modifier=".cg",
        )  # [BLOCK_H, BLOCK_D]
        m_new = tl.maximum(m, lse)
        alpha, beta = tl.exp2(m - m_new), tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * beta[:, None]
        w = w * alpha + beta
        m = m_new
    return acc / w[:, None]


@triton.jit
def _write_output(
    out,
    m_i,
    l_safe,
    out_ptrs,
    out_mask,
    part_out_ptr,
    part_lse_ptr,
    counts_ptr,
    seq,
    kv_head,
    tokens,
    heads,
    h_mask,
    offs_d,
    split,
    num_valid,
    num_splits,
    NUM_HEADS: tl.constexpr,
    KVH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """This program's output [BLOCK_H, BLOCK_D] to out_ptrs; with several splits that see keys,
    its partial result and log-sum-exp (base 2) go to the split buffers instead, and the last of
    the sequence's splits to finish (counted with an atomic) merges them and resets the count."""
    if SPLIT:
        if num_valid > 1:
            first_row = (
                tokens.to(tl.int64) * NUM_HEADS + heads
            ) * num_splits  # [BLOCK_H]: split 0's rows
            tl.store(
                part_out_ptr + (first_row + split)[:, None] * HEAD_DIM + offs_d[None, :],
                out,
                mask=out_mask,
            )
            tl.store(part_lse_ptr + first_row + split, m_i + tl.log2(l_safe), mask=h_mask)
            tl.debug_barrier()  # all of this program's partials are written before it counts itself
            count_ptr = counts_ptr + seq * KVH + kv_head
            if tl.atomic_add(count_ptr, 1, sem="acq_rel") == num_valid - 1:  # the others are done
                # fmt: off
                out = _merge_splits(
                    part_out_ptr, part_lse_ptr, first_row, num_valid, num_splits, offs_d, out_mask,
                    h_mask, HEAD_DIM, BLOCK_H, BLOCK_D,
                )
                # fmt: on
                tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(count_ptr, 0)  # ready for the next launch
        else:  # the whole context in one split: its result is the output
            tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # (S, H, D) output
    part_out_ptr,
    part_lse_ptr,  # (S, H, num_splits, D), (S, H, num_splits) fp32 (when SPLIT)
    counts_ptr,  # (S * KVH,) int32 zeros: finished splits (when SPLIT), reset by the merge
    new_k_ptr,
    new_v_ptr,
    slot_ptr,  # (S, KVH, D) x2 and (S,): the new tokens' K/V and slots (when STORE)
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_w_ptr,
    k_w_ptr,  # (S,), (positions, D) x2, (D,) x2: RoPE and q/k norms (when ROPE)
    context_lens_ptr,
    block_tables_ptr,
    order_ptr,  # (S,) int32: the sequences in launch order (when ORDERED)
    cu_seqlens_q_ptr,  # (S + 1,) int32: each sequence's first token (when MAX_Q > 1)
    k_scale_ptr,
    v_scale_ptr,  # (KVH,) fp32, read when FP8
    q_scale_ptr,  # (1,) fp32: q's static scale, read when FP8_DOT and not Q_DYNAMIC
    qk_scale,  # softmax scale * log2(e)
    eps,  # the q/k norms' epsilon
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_nk,
    stride_nkh,
    stride_nv,
    stride_nvh,
    stride_cos,
    stride_bt,
    num_splits,
    NUM_HEADS: tl.constexpr,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # False: one split, write `out` directly
    STORE: tl.constexpr,  # write the new tokens' K/V first
    ROPE: tl.constexpr,  # q and new K come unrotated: rotate them (HAS_NORM: norms first)
    HAS_NORM: tl.constexpr,
    ORDERED: tl.constexpr,  # program i handles sequence order[i]
    MAX_Q: tl.constexpr,  # 1: a query per sequence, token i of sequence i; else up to MAX_Q (a
    # power of two) from cu_seqlens_q
    BLOCK_G: tl.constexpr,  # GROUP * MAX_Q padded to a power of two
    BLOCK_H: tl.constexpr,  # and to at least 16 (tl.dot's least M): _group_rows
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the cache is float8 e4m3 (see _load_kv_tile)
    FP8_DOT: tl.constexpr,
    PV_FP8: tl.constexpr,
    Q_DYNAMIC: tl.constexpr,
    ROUND: tl.constexpr,  # see _fp8_launch
    PDL: tl.constexpr,  # launched with programmatic dependent launch (launch.py)
):
    wait_for_prior_kernel(PDL)
    # The kv head is the fastest grid axis, so the GPU starts programs sequence by sequence
    # in `order`: longest contexts first, the short ones fill in behind them.
    kv_head = tl.program_id(0)
    if ORDERED:
        seq = tl.load(order_ptr + tl.program_id(1))
    else:
        seq = tl.program_id(1)
    split = tl.program_id(2)
    if MAX_Q == 1:
        q_start, q_len = seq, 1
    else:
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start

    # The GROUP query heads that share this kv head, at each of the sequence's new tokens, are
    # the rows of one matrix, so each K/V tile is loaded once for all of them (padding rows are
    # masked).
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_mask = offs_d < HEAD_DIM
    tokens, heads, h_mask = _group_rows_of(q_start, q_len, kv_head, BLOCK_H, GROUP)  # [BLOCK_H]
    out_mask = h_mask[:, None] & d_mask[None, :]
    out_ptrs = (
        out_ptr
        + tokens.to(tl.int64)[:, None] * stride_os
        + heads[:, None] * stride_oh
        + offs_d[None, :]
    )

    context_len = tl.load(context_lens_ptr + seq)
    kv_start, kv_end, num_valid = _split_range(
        context_len, q_len, split, num_splits, SPLIT, BLOCK_N
    )
    if kv_start >= kv_end:  # a split past a short context: nothing to do
        if context_len == 0 and split == 0:  # a padding row: zeros
            tl.store(
                out_ptrs,
                tl.zeros([BLOCK_H, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )
        return

    k_s, v_s = _kv_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8)
    if STORE and kv_end == context_len:  # this program holds the last keys: the new tokens'
        # fmt: off
        _store_new_kv(
            new_k_ptr, new_v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_start, q_len, kv_head, k_s,
            v_s, offs_d, d_mask, pos_ptr, cos_ptr, sin_ptr, stride_cos, k_w_ptr, eps, stride_nk,
            stride_nkh, stride_nv, stride_nvh, stride_cb, stride_cs, stride_ch, HEAD_DIM, PAGE_SIZE,
            ROPE, HAS_NORM, FP8, MAX_Q,
        )
        # fmt: on
    # fmt: off
    q = _load_group_q(
        q_ptr, q_start, q_len, kv_head, pos_ptr, cos_ptr, sin_ptr, stride_cos, q_w_ptr, eps, offs_d,
        stride_qs, stride_qh, GROUP, HEAD_DIM, ROPE, HAS_NORM, BLOCK_G, BLOCK_H, BLOCK_D,
    )
    # fmt: on
    q, qk_scale = _q_operand(q, qk_scale, k_s, q_scale_ptr, FP8, FP8_DOT, Q_DYNAMIC, ROUND)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # A single query is the last position, so every key < context_len is visible: the only
    # mask needed is the end of the context (or of this split); with several, each row also
    # stops at its own token's position. The loads need none: a tile's rows past the end read
    # the last key again (always a valid slot), and the scores' mask gives them no weight:
    # fewer instructions per tile than masked loads.
    last_key = context_len - q_len + tl.minimum(tokens - q_start, q_len - 1)  # [BLOCK_H]
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_mask = offs_n < kv_end
        if MAX_Q == 1:
            mask = n_mask[None, :]
        else:
            mask = n_mask[None, :] & (offs_n[None, :] <= last_key[:, None])  # [BLOCK_H, BLOCK_N]
        rows = tl.minimum(offs_n, kv_end - 1)  # [BLOCK_N] valid positions
        # fmt: off
        k = _load_kv_tile(
            k_cache_ptr, bt_row, rows, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE, False, HEAD_DIM < BLOCK_D,
        )  # [BLOCK_N, BLOCK_D]
        v = _load_kv_tile(
            v_cache_ptr, bt_row, rows, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
            stride_ch, PAGE_SIZE, False, HEAD_DIM < BLOCK_D,
        )  # [BLOCK_N, BLOCK_D]
        # fmt: on
        m_i, l_i, acc = _online_softmax_step(
            q, k, v, m_i, l_i, acc, qk_scale, mask, True, PV_FP8, ROUND
        )

    if PV_FP8:
        v_s = v_s / FP8_MAX  # P was scaled by FP8_MAX
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc * (v_s / l_safe)[:, None]  # [BLOCK_H, BLOCK_D]: sum p * (v * v_s) / l
    # fmt: off
    _write_output(
        out, m_i, l_safe, out_ptrs, out_mask, part_out_ptr, part_lse_ptr, counts_ptr, seq, kv_head,
        tokens, heads, h_mask, offs_d, split, num_valid, num_splits, NUM_HEADS, KVH, HEAD_DIM,
        SPLIT, BLOCK_H, BLOCK_D,
    )
    # fmt: on


def _group_rows(group: int, flags: dict, num_warps: int, device: torch.device) -> int:
    """BLOCK_H, the rows of the decode kernel's products: `group` (the GQA group's heads times the
    queries per sequence) padded to a power of two and to at least 16 (tl.dot's least M); 64 for e4m3 products on Hopper with a multiple of 4 warps:
    there only warpgroup MMA (64 rows a warpgroup) multiplies e4m3, and Triton widens the operands
    of a smaller product to fp16 (Ada's mma.sync takes e4m3 at 16 rows). The padding rows cost
    tensor-core time only, which a decode step has to spare."""
    rows = max(16, triton.next_power_of_2(group))
    hopper = device.type == "cuda" and tuning.describe(device).capability[0] == 9
    return max(rows, 64) if flags["FP8_DOT"] and hopper and num_warps % 4 == 0 else rows


def default_num_splits(
    num_seqs: int,
    kv_heads: int,
    max_context: int,
    device: torch.device,
    BLOCK_N: int,
    programs_per_sm: int,
) -> int:
    """Split-K factor for decode: 1 when the batch alone fills the GPU (programs_per_sm programs
    on every SM), else enough splits for the tuning's waves of them (at most one split per key
    tile, at most its max_splits)."""
    programs, sms = num_seqs * kv_heads, tuning.describe(device).sms
    if device.type != "cuda" or programs >= programs_per_sm * sms:
        return 1
    rule = tuning.for_device(device).decode_splits()
    waves = triton.cdiv(rule["waves"] * programs_per_sm * sms, programs)
    return max(1, min(waves, triton.cdiv(max_context, BLOCK_N), rule["max_splits"]))


def _split_buffers(
    q: torch.Tensor,
    kv_heads: int,
    num_splits: int,
    counters: SplitCounters | None,
    out: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple:
    """(part_out, part_lse, counts) of split-K: each split's output and log-sum-exp, and the
    counters; without splits, stand-ins (unread)."""
    assert num_splits >= 1
    if num_splits == 1:
        return out, out, context_lens
    num_seqs, num_heads, head_dim = q.shape
    part_out = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    return part_out, part_lse, (counters or SplitCounters()).get(q.device, num_seqs * kv_heads)


def _new_kv_args(q: torch.Tensor, kv_heads: int, new_kv: tuple | None) -> tuple:
    """(new_k, new_v, slot_mapping) for the decode launch, checked; q stands in for each (unread) without them."""
    if new_kv is None:
        return q, q, q
    new_k, new_v, slot_mapping = new_kv  # (seqs, kv_heads, head_dim) x2, (seqs,)
    num_seqs, _, head_dim = q.shape
    assert new_k.shape == new_v.shape == (num_seqs, kv_heads, head_dim) and slot_mapping.shape == (
        num_seqs,
    )
    assert new_k.stride(-1) == 1 and new_v.stride(-1) == 1
    return new_kv


def _rope_args(q: torch.Tensor, new_kv: tuple | None, rope: tuple | None) -> tuple:
    """(positions, cos, sin, q_norm weight, k_norm weight, eps) for a launch that rotates q and the
    new K (decode, store_kvcache), checked; q stands in for the tensors (unread) without rope."""
    if rope is None:
        return q, q, q, None, None, 0.0
    assert new_kv is not None, "rope rotates the new K as it stores it: it needs new_kv"
    positions, cos, sin, q_w, k_w, _ = (
        rope  # (seqs,), (positions, head_dim) x2, (head_dim,) x2 or None
    )
    assert positions.shape == (q.shape[0],) and cos.shape[1] == q.shape[2]
    assert cos.is_contiguous() and sin.is_contiguous()
    assert (q_w is None) == (k_w is None)
    return rope


def _decode_tiles(
    q, flags, num_seqs, kv_heads, max_context, block_n, num_warps, num_stages, num_splits
):
    """(BLOCK_N, num_warps, num_stages, num_splits) of a decode launch: each one given, else the
    device's tuning (the split-K factor from default_num_splits)."""
    tiles = tuning.for_device(q.device).decode(flags["FP8"], q.shape[2])
    block_n = block_n or tiles["BLOCK_N"]
    if num_splits is None:
        num_splits = default_num_splits(
            num_seqs, kv_heads, max_context, q.device, block_n, tiles["programs_per_sm"]
        )
    return (
        block_n,
        num_warps or tiles["num_warps"],
        num_stages or tiles["num_stages"],
        num_splits,
    )


def paged_decode_attention(
    q: torch.Tensor,  # (num_seqs, heads, head_dim), one query per sequence (or see cu_seqlens_q)
    k_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_blocks, block_size, kv_heads, head_dim)
    context_lens: torch.Tensor,  # (num_seqs,) int32, includes the current token
    block_tables: torch.Tensor,  # (num_seqs, max_blocks) int32, padded with -1
    scale: float,
    order: torch.Tensor | None = None,  # (num_seqs,) int32: the sequences' launch order
    num_splits: int | None = None,  # split-K factor; None = default_num_splits(...)
    BLOCK_N: int | None = None,  # keys per tile; this and the two below, None: the device's tuning
    num_warps: int | None = None,
    num_stages: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32, for an fp8 cache
    v_scale: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, ...] | None = None,  # (k, v, slot_mapping) of the new tokens
    rope: tuple | None = None,  # (positions, cos, sin, q_norm weight | None, k_norm's, eps)
    counters: SplitCounters | None = None,  # split-K's; None: fresh ones (not in a CUDA graph)
    fp8_dot: bool | None = None,  # e4m3 tensor-core products (_fp8_launch); None: the device's
    pv_fp8: bool | None = None,
    q_scale: torch.Tensor | None = None,
    BLOCK_H: int | None = None,  # rows of the products (_group_rows); None: the device's least
    cu_seqlens_q: torch.Tensor | None = None,  # (num_seqs + 1,) int32: several queries each
    max_seqlen_q: int = 1,  # with cu_seqlens_q: the most queries of a sequence (at most decode_queries)
) -> torch.Tensor:  # (num_seqs, heads, head_dim), q.dtype (or (tokens, ...): see cu_seqlens_q)
    """Attention of each sequence's single query (position context_len - 1) over its cache: one
    program per (sequence, kv head[, split]) for all query heads of the GQA group. The launch
    reads no device values (graph-capturable); a context_len of 0 gives zeros. `new_kv` and
    `rope`: see "Decode" above. `order` changes only which programs start first: in a batch of
    mixed lengths, longest first keeps the last wave short (the runner passes it, step_input.py).

    With `cu_seqlens_q`, a sequence has a few queries, its last q_len positions (q packed as for
    prefill, q_len up to max_seqlen_q): a verify step's 1 + k. The program's rows are then the
    group's heads at each of them, each masked causally; its last split, which the split-K cut
    makes hold every new key, stores them all."""
    (num_tokens, num_heads, head_dim), kv_heads, page_size = q.shape, *k_cache.shape[2:0:-1]
    assert num_heads % kv_heads == 0 and k_cache.shape[3] == head_dim
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    assert cu_seqlens_q is not None or max_seqlen_q == 1, "several queries need cu_seqlens_q"
    assert 1 <= max_seqlen_q <= decode_queries, f"at most {decode_queries} queries per sequence"
    group, num_seqs = num_heads // kv_heads, context_lens.shape[0]
    max_q = triton.next_power_of_2(max_seqlen_q) if cu_seqlens_q is not None else 1
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0 or num_tokens == 0:
        return out
    scales, flags = _fp8_launch("decode", q, k_cache, k_scale, v_scale, fp8_dot, pv_fp8, q_scale)
    max_ctx = block_tables.shape[1] * page_size  # an upper bound on any context_len
    tiles = (BLOCK_N, num_warps, num_stages, num_splits)
    BLOCK_N, num_warps, num_stages, num_splits = _decode_tiles(
        q, flags, num_seqs, kv_heads, max_ctx, *tiles
    )
    # the split-K partials: out, lse, counts
    splits = _split_buffers(q, kv_heads, num_splits, counters, out, context_lens)
    new_k, new_v, slot_mapping = _new_kv_args(q, kv_heads, new_kv)
    positions, cos, sin, q_w, k_w, eps = _rope_args(q, new_kv, rope)
    # a line per group of arguments: pointers, strides, compile-time flags
    # fmt: off
    _paged_decode_kernel[(kv_heads, num_seqs, num_splits)](
        q, k_cache, v_cache, out, *splits, new_k, new_v, slot_mapping,
        positions, cos, sin, q if q_w is None else q_w, q if k_w is None else k_w,
        context_lens, block_tables, order if order is not None else context_lens,
        cu_seqlens_q if cu_seqlens_q is not None else context_lens, *scales, scale * LOG2E, eps, *q.stride()[:2], *out.stride()[:2], *k_cache.stride()[:3],
        *new_k.stride()[:2], *new_v.stride()[:2], cos.stride(0), block_tables.stride(0), num_splits,
        NUM_HEADS=num_heads, KVH=kv_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        SPLIT=num_splits > 1, STORE=new_kv is not None, ROPE=rope is not None, HAS_NORM=q_w is not None,
        ORDERED=order is not None and num_splits == 1,  # splits balance the work themselves
        MAX_Q=max_q, BLOCK_G=triton.next_power_of_2(group * max_q),
        BLOCK_H=BLOCK_H or _group_rows(group * max_q, flags, num_warps, q.device),
        BLOCK_N=BLOCK_N, BLOCK_D=_block_d(head_dim, flags, BLOCK_N), **flags,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device),
    )
    # fmt: on
    return out
