"""Fused elementwise kernels in Triton: RMSNorm (with the residual add), rotary embedding
(after Qwen3's per-head q/k RMSNorm where the model has it), SiLU-and-multiply. One launch
and one pass over memory each, where the PyTorch code in norm.py, rotary.py and
activation.py (the reference, and the CPU path) takes 4 to 12 (24 for q/k norm and RoPE).
And the sampler's kernels (sampler.py): temperature-only Gumbel-max, one pass over the logits
and a small combining launch, for three elementwise passes over the logits' shape, two
argmaxes and a select; each row's top-k candidates (its k largest logits), two launches for
five; and the draw among them (softmax, top-k / top-p / min-p masks, Gumbel-max), one launch
for about twenty. Both draws hash each token's Exp(1) noise from a key per row in registers.

The layers call these on CUDA tensors only. Each kernel rounds to the input dtype at the
same points as the PyTorch reference, so bf16 results match it up to the order of a
float32 sum. tests/test_fused_kernels.py checks them against the reference under
TRITON_INTERPRET=1.
"""

import torch
import triton
import triton.language as tl

from .launch import pdl_args, wait_for_prior_kernel


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (nearest, ties to even) and widened back. For bf16 by
    integer arithmetic on the bits: a compiler may fold a plain down-and-up cast away."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


# ---------------------------------------------------------------------------------------
# RMSNorm, optionally after adding the residual stream
# ---------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_xt, stride_xh, stride_rt,            # x: (T, H, D) with a contiguous last dim
    eps,
    H: tl.constexpr, D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)  # one token: all its H rows of D
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)  # [BLOCK_H, BLOCK_D]
    x = tl.load(x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:  # H == 1: x + residual, rounded like the reference's add, is the new stream
        r = tl.load(res_ptr + t * stride_rt + offs_d[None, :], mask=mask, other=0.0)
        x = _rounded(x + r.to(tl.float32), dtype)
        tl.store(res_out_ptr + t * D + offs_d[None, :], x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_H]
    y = _rounded(x * rstd[:, None], dtype)  # the reference rounds before the weight
    w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)  # [BLOCK_D]
    tl.store(out_ptr + (t * H + offs_h[:, None]) * D + offs_d[None, :], (w[None, :] * y).to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,  # (T, D) or (T, H, D): normalised over D; last dim contiguous
    weight: torch.Tensor,  # (D,)
    eps: float,
    residual: torch.Tensor | None = None,  # (T, D), added to x first
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * x / rms(x); with `residual`, returns (norm(x + residual), x + residual).
    Outputs are contiguous, in x's dtype."""
    assert x.stride(-1) == 1 and weight.shape == (x.shape[-1],)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)  # (T, H, D)
    tokens, heads, dim = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert x.dim() == 2 and residual.shape == x.shape and residual.stride(-1) == 1
        res_out = torch.empty_like(out)
    if tokens > 0:
        block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
        _rms_norm_kernel[(tokens,)](
            x3, residual if residual is not None else x3, weight, out, res_out if residual is not None else out,
            x3.stride(0), x3.stride(1), residual.stride(0) if residual is not None else 0,
            eps, H=heads, D=dim, HAS_RESIDUAL=residual is not None,
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_warps(block_h * block_d), **pdl_args(x.device),
        )
    return out if residual is None else (out, res_out)


# ---------------------------------------------------------------------------------------
# Rotary embedding ("rotate half": x * cos + [-x2, x1] * sin), q and k in one launch,
# optionally after Qwen3's per-head RMSNorm of q and k (q_norm, k_norm)
# ---------------------------------------------------------------------------------------


@triton.jit
def rope_rows(x_ptr, row_offs, rows_ok, pos, cos_ptr, sin_ptr, stride_cos, w_ptr, eps,
              offs_d, D: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows of head_dim D at x_ptr + row_offs (a [ROWS] tensor; rows_ok masks them), rotated
    for position `pos`: [ROWS, BLOCK_D] float32 holding values of x's dtype (0 past D). Each
    lane d reads x[d] and its rotate-half partner x[d +- D/2]: out = x c + sign x' s, sign
    -1 in the first half. With HAS_NORM, x is first w * x / rms(x) per row (Qwen3's q_norm,
    k_norm). Every product and the sum are rounded to x's dtype where the reference rounds."""
    half = D // 2
    d_ok = offs_d < D
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)  # [BLOCK_D]
    mask = rows_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + row_offs[:, None] + offs_d[None, :], mask=mask, other=0.0)  # [ROWS, BLOCK_D]
    dtype = x.dtype
    x = x.to(tl.float32)
    xs = tl.load(x_ptr + row_offs[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # the norm's output is the rotation's input: rounded to dtype, as between two layers
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [ROWS, 1]
        w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_D]
        ws = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = _rounded(w * _rounded(x * rstd, dtype), dtype)
        xs = _rounded(ws * _rounded(xs * rstd, dtype), dtype)
    # cos/sin tables are (positions, D) with both halves equal; rounded to the inputs' dtype
    # like the reference's `.to(q.dtype)`
    c = _rounded(tl.load(cos_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32), dtype)[None, :]
    s = _rounded(tl.load(sin_ptr + pos * stride_cos + offs_d, mask=d_ok, other=0.0).to(tl.float32), dtype)[None, :]
    sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
    return _rounded(_rounded(x * c, dtype) + sign * _rounded(xs * s, dtype), dtype)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, eps,
    QH: tl.constexpr, KH: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)  # one token: its q heads, then its k heads
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = offs_d < D
    offs_qh = tl.arange(0, BLOCK_QH)  # [BLOCK_QH]
    q = rope_rows(q_ptr + t * stride_qt, offs_qh * stride_qh, offs_qh < QH, pos, cos_ptr, sin_ptr, stride_cos,
                  q_w_ptr, eps, offs_d, D, HAS_NORM)
    tl.store(q_out_ptr + (t * QH + offs_qh[:, None]) * D + offs_d[None, :], q.to(q_out_ptr.dtype.element_ty),
             mask=(offs_qh[:, None] < QH) & d_ok[None, :])
    offs_kh = tl.arange(0, BLOCK_KH)
    k = rope_rows(k_ptr + t * stride_kt, offs_kh * stride_kh, offs_kh < KH, pos, cos_ptr, sin_ptr, stride_cos,
                  k_w_ptr, eps, offs_d, D, HAS_NORM)
    tl.store(k_out_ptr + (t * KH + offs_kh[:, None]) * D + offs_d[None, :], k.to(k_out_ptr.dtype.element_ty),
             mask=(offs_kh[:, None] < KH) & d_ok[None, :])


def rotary(
    positions: torch.Tensor,  # (T,) int
    q: torch.Tensor,  # (T, heads, head_dim), last dim contiguous
    k: torch.Tensor,  # (T, kv_heads, head_dim), last dim contiguous
    cos: torch.Tensor,  # (max_positions, head_dim), both halves equal
    sin: torch.Tensor,  # (max_positions, head_dim)
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,  # q_norm's and k_norm's (head_dim,)
    eps: float = 0.0,  # the norms' epsilon
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (contiguous), as RotaryEmbedding.forward computes them;
    with `norm_weights`, of RMSNorm(q) and RMSNorm(k) per head (Qwen3's q_norm, k_norm)."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    assert head_dim % 2 == 0 and k.shape == (tokens, k_heads, head_dim)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    q_w, k_w = norm_weights if norm_weights is not None else (q, k)  # unread without the norm
    assert norm_weights is None or q_w.shape == k_w.shape == (head_dim,)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens > 0:
        block_qh = triton.next_power_of_2(q_heads)
        _rotary_kernel[(tokens,)](
            q, k, q_out, k_out, positions, cos, sin, q_w, k_w,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), eps,
            QH=q_heads, KH=k_heads, D=head_dim, HAS_NORM=norm_weights is not None,
            BLOCK_QH=block_qh, BLOCK_KH=triton.next_power_of_2(k_heads),
            BLOCK_D=triton.next_power_of_2(head_dim), num_warps=_warps(block_qh * head_dim // 2),
        )
    return q_out, k_out


# ---------------------------------------------------------------------------------------
# SwiGLU's gate: silu(gate) * up
# ---------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_prior_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < N
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + N + offs, mask=mask, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = _rounded(g / (1.0 + tl.exp(-g)), dtype)  # F.silu, rounded like the reference
    tl.store(out_ptr + t * N + offs, (act * up.to(tl.float32)).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: (T, 2N) = [gate | up] -> (T, N) = silu(gate) * up, contiguous."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1
    tokens, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    if tokens > 0:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(tokens, triton.cdiv(n, block))](x, out, x.stride(0), N=n, BLOCK=block, num_warps=_warps(block), **pdl_args(x.device))
    return out


# ---------------------------------------------------------------------------------------
# The sampler's noise: each token's Exp(1) value hashed from its row's key and its token id
# ---------------------------------------------------------------------------------------


@triton.jit
def _mix32(h):
    """sampler._mix32 on uint32 (MurmurHash3's finaliser; the products wrap mod 2**32)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _keyed_exponential(key, token_ids):
    """sampler.keyed_exponential in registers: a row's key (int64 in [0, 2**32)) and token
    ids [BLOCK] -> their Exp(1) noise [BLOCK] float32, the same bits as the PyTorch code."""
    k = key.to(tl.uint32)
    h = _mix32(_mix32(k ^ (token_ids.to(tl.uint32) * 0x27D4EB2F)) ^ k)
    u = tl.minimum(((h >> 8).to(tl.float32) + 0.5) * (2.0**-24), 1 - 2.0**-24)  # uniform in (0, 1), never 1
    return -tl.log(u)


# ---------------------------------------------------------------------------------------
# The sampler's temperature-only draw: Gumbel-max argmax(logits / T - log E), and the
# greedy argmax of the rows at T = 0, in one pass over the logits
# ---------------------------------------------------------------------------------------


@triton.jit
def _gumbel_argmax_chunk_kernel(
    logits_ptr, key_ptr, temp_ptr, best_ptr, best_id_ptr,
    stride_l, V, CHUNKS, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """The maximum and its first index in one chunk of a row: of the logits in a greedy row
    (T = 0), of the Gumbel-max score in the others (only they hash noise)."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < V
    logit = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    t = tl.load(temp_ptr + row)
    if t == 0:
        best, best_i = tl.max(logit, axis=0, return_indices=True, return_indices_tie_break_left=True)
    else:
        e = _keyed_exponential(tl.load(key_ptr + row), offs)
        # float32 as the reference computes it: the logit widened, an IEEE division, libdevice's log
        score = tl.div_rn(logit, tl.maximum(t, 1e-5)) - tl.log(e)  # -inf in the masked lanes; T clamped as by_temperature
        best, best_i = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = row * CHUNKS + chunk
    tl.store(best_ptr + out, best)
    tl.store(best_id_ptr + out, chunk * BLOCK + best_i.to(tl.int64))


@triton.jit
def _gumbel_argmax_combine_kernel(best_ptr, best_id_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """The id of a row's largest chunk maximum: the first chunk's on a tie, as argmax's."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    v = tl.load(best_ptr + row * CHUNKS + offs, mask=offs < CHUNKS, other=float("-inf"))
    _, c = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(best_id_ptr + row * CHUNKS + c))


def gumbel_argmax(
    logits: torch.Tensor,  # (rows, vocab), any float dtype, last dim contiguous
    keys: torch.Tensor,  # (rows,) int64 in [0, 2**32): each row's noise key
    temperatures: torch.Tensor,  # (rows,) float32, 0 = greedy
) -> torch.Tensor:  # (rows,) int64
    """argmax(logits / max(T, 1e-5) - log(noise)) per row with noise =
    sampler.keyed_exponential(keys, token ids), argmax(logits) where T = 0 (the first index on a
    tie, as torch.argmax): the Sampler's temperature-only draw, in two launches, reading the
    logits only."""
    rows, vocab = logits.shape
    assert keys.shape == (rows,) and keys.dtype == torch.int64 and temperatures.shape == (rows,)
    assert logits.stride(-1) == 1 and temperatures.dtype == torch.float32
    block = min(4096, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows > 0:
        temperatures = temperatures.contiguous()
        _gumbel_argmax_chunk_kernel[(rows, chunks)](
            logits, keys.contiguous(), temperatures, best, best_id,
            logits.stride(0), vocab, chunks, BLOCK=block, num_warps=_warps(block), **pdl_args(logits.device),
        )
        _gumbel_argmax_combine_kernel[(rows,)](best, best_id, out, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                                               num_warps=1, **pdl_args(logits.device))
    return out


# ---------------------------------------------------------------------------------------
# The sampler's candidates: each row's k largest logits (sampler.top_candidates)
# ---------------------------------------------------------------------------------------

_REMOVED = tl.constexpr(-(2**31))  # an order key below every float's (_order_key): taken or padding


@triton.jit
def _order_key(x):
    """float32 x as int32 keys in the same order (-inf < finite < +inf < positive NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """_order_key's inverse."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _group_max_kernel(x_ptr, out_ptr, stride_x, num_groups, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr):
    """out[row, g] = max of logits g * GROUP .. (g + 1) * GROUP - 1, for BLOCK_G groups a program."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    ok = groups < num_groups
    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok[:, None], other=float("-inf"))
    tl.store(out_ptr + row.to(tl.int64) * num_groups + groups, tl.max(x, axis=1).to(tl.float32), mask=ok)


@triton.jit
def _top_groups_kernel(x_ptr, maxima_ptr, values_ptr, ids_ptr, stride_x, num_groups, k,
                       GROUP: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Per row: the k groups of largest maxima, then the k largest logits among those groups'
    k * GROUP, largest first (an argmax taken out k times, over order keys)."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_NG)  # [BLOCK_NG]
    keys = tl.load(maxima_ptr + row * num_groups + offs_g, mask=offs_g < num_groups, other=0.0)
    keys = tl.where(offs_g < num_groups, _order_key(keys), _REMOVED)
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top = tl.zeros([BLOCK_K], tl.int32)  # the groups taken, in order
    for i in range(0, k):
        best = tl.argmax(keys, axis=0)
        top = tl.where(offs_k == i, best, top)
        keys = tl.where(offs_g == best, _REMOVED, keys)
    ids = top[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_K, GROUP] token ids
    taken = (offs_k < k)[:, None]
    x = tl.load(x_ptr + row * stride_x + ids, mask=taken, other=0.0).to(tl.float32)
    keys = tl.where(taken, _order_key(x), _REMOVED)  # [BLOCK_K, GROUP]
    flat = offs_k[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_K, GROUP]: each candidate's place
    for i in range(0, k):
        key = tl.max(tl.max(keys, axis=1), axis=0)
        place = tl.min(tl.min(tl.where(keys == key, flat, BLOCK_K * GROUP), axis=1), axis=0)  # the first holding it
        tl.store(values_ptr + row * k + i, _key_value(key).to(values_ptr.dtype.element_ty))
        tl.store(ids_ptr + row * k + i, tl.sum(tl.sum(tl.where(flat == place, ids, 0), axis=1), axis=0).to(tl.int64))
        keys = tl.where(flat == place, _REMOVED, keys)


def top_candidates(logits: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sampler.top_candidates' grouped pass in two launches (for its five): the maxima of the
    groups of `group` logits, then per row the top k of the k groups of largest maxima. Values
    (rows, k) in logits' dtype, largest first, and their ids (rows, k) int64 (equal values: any)."""
    rows, vocab = logits.shape
    assert vocab % group == 0 and k * group <= vocab and logits.stride(-1) == 1
    num_groups = vocab // group
    values = torch.empty(rows, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    if rows == 0 or k == 0:
        return values, ids
    maxima = torch.empty(rows, num_groups, dtype=torch.float32, device=logits.device)
    block_g = max(1, 4096 // group)
    _group_max_kernel[(rows, triton.cdiv(num_groups, block_g))](logits, maxima, logits.stride(0), num_groups,
                                                                 GROUP=group, BLOCK_G=block_g, num_warps=4, **pdl_args(logits.device))
    block_k = triton.next_power_of_2(k)
    _top_groups_kernel[(rows,)](logits, maxima, values, ids, logits.stride(0), num_groups, k,
                                GROUP=group, BLOCK_NG=triton.next_power_of_2(num_groups), BLOCK_K=block_k,
                                num_warps=_warps(block_k * group), **pdl_args(logits.device))
    return values, ids


# ---------------------------------------------------------------------------------------
# The sampler's draw among each row's top-k candidates: temperature, softmax, the top-k /
# top-p / min-p masks and Gumbel-max, in one launch (one program per row)
# ---------------------------------------------------------------------------------------


@triton.jit
def _candidates_draw_kernel(
    values_ptr, ids_ptr, key_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, out_ptr,
    stride_v, stride_i, K,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # [BLOCK]: the candidates, most likely first
    valid = offs < K
    x = tl.load(values_ptr + row * stride_v + offs, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.div_rn(x, tl.maximum(tl.load(temp_ptr + row), 1e-5))  # sampler.by_temperature
    e = tl.exp(x - tl.max(x, axis=0))  # 0 in the masked lanes
    p = tl.div_rn(e, tl.sum(e, axis=0))  # softmax over the candidates
    keep = valid
    kept = p  # sampler.keep_sorted's sorted_p
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        keep = keep & (offs < tl.where(k > 0, k, K))
        kept = tl.where(keep, p, 0.0)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        before = tl.cumsum(kept, axis=0) - kept  # the mass of the more likely candidates
        bound = tl.where(top_p >= 1, float("inf"), top_p * tl.sum(kept, axis=0))  # top_p 1: keep all
        keep = keep & (before < bound)
    if HAS_MIN_P:
        keep = keep & (p >= tl.load(min_p_ptr + row) * tl.max(p, axis=0))
    ids = tl.load(ids_ptr + row * stride_i + offs, mask=valid, other=0)
    noise = _keyed_exponential(tl.load(key_ptr + row), ids)
    score = tl.div_rn(tl.where(keep, p, 0.0), noise)  # Gumbel-max: argmax(p / E)
    _, choice = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * stride_i + choice).to(tl.int64))


def candidates_draw(
    values: torch.Tensor,  # (rows, k) each row's k largest logits, largest first, any float dtype
    ids: torch.Tensor,  # (rows, k) int64: their token ids
    keys: torch.Tensor,  # (rows,) int64 in [0, 2**32): each row's noise key
    temperatures: torch.Tensor,  # (rows,) float32
    top_k: torch.Tensor | None = None,  # (rows,) int, 1..k (0 = all k)
    top_p: torch.Tensor | None = None,  # (rows,) float32, 1 = off
    min_p: torch.Tensor | None = None,  # (rows,) float32, 0 = off
) -> torch.Tensor:  # (rows,) int64 token ids
    """The Sampler's draw over the candidates (its `max_k` path, greedy rows aside): softmax of
    values / T, keep_sorted's top-k and top-p, min-p against the most likely, then the id of
    argmax(p / noise) with noise = sampler.keyed_exponential(keys, ids), the first on a tie as
    torch.argmax's. One launch for the ~20 that the PyTorch code takes."""
    rows, k = values.shape
    assert ids.shape == (rows, k) and keys.shape == (rows,) and keys.dtype == torch.int64 and temperatures.shape == (rows,)
    assert values.stride(-1) == 1 and ids.stride(-1) == 1 and temperatures.dtype == torch.float32
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows > 0:
        unused = temperatures  # any pointer stands in for an absent mask (never read)
        block = max(16, triton.next_power_of_2(k))
        _candidates_draw_kernel[(rows,)](
            values, ids, keys.contiguous(), temperatures.contiguous(),
            unused if top_k is None else top_k.contiguous(), unused if top_p is None else top_p.contiguous(),
            unused if min_p is None else min_p.contiguous(), out,
            values.stride(0), ids.stride(0), k,
            HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
            BLOCK=block, num_warps=_warps(block), **pdl_args(values.device),
        )
    return out
