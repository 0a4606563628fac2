"""RMSNorm (with the residual add) and the rotary embedding (after Qwen3's per-head q/k
RMSNorm where the model has it) in Triton: one launch and one pass over memory each, where
the PyTorch code takes 4 to 12 (24 for q/k norm and RoPE). References: layers/norm.py's
RMSNorm and layers/rotary.py's RotaryEmbedding (the PyTorch code, and the CPU path). Each
kernel rounds to the input dtype at the same points as the reference, so bf16 results match
it up to the order of a float32 sum; tests/test_fused_kernels.py checks them against it under
TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

from .common import rounded, warps
from .launch import pdl_args, wait_for_prior_kernel

# ---------------------------------------------------------------------------------------
# RMSNorm, optionally after adding the residual stream
# ---------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_xt,
    stride_xh,
    stride_rt,  # x: (T, H, D) with a contiguous last dim
    eps,
    H: tl.constexpr,
    D: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)  # one token: all its H rows of D
    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)  # [BLOCK_H, BLOCK_D]
    x = tl.load(
        x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :], mask=mask, other=0.0
    )
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:  # H == 1: x + residual, rounded like the reference's add, is the new stream
        r = tl.load(res_ptr + t * stride_rt + offs_d[None, :], mask=mask, other=0.0)
        x = rounded(x + r.to(tl.float32), dtype)
        tl.store(res_out_ptr + t * D + offs_d[None, :], x.to(dtype), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [BLOCK_H]
    y = rounded(x * rstd[:, None], dtype)  # the reference rounds before the weight
    w = tl.load(w_ptr + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)  # [BLOCK_D]
    tl.store(
        out_ptr + (t * H + offs_h[:, None]) * D + offs_d[None, :],
        (w[None, :] * y).to(dtype),
        mask=mask,
    )


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
        # fmt: off
        _rms_norm_kernel[(tokens,)](
            x3, residual if residual is not None else x3, weight, out,
            res_out if residual is not None else out, x3.stride(0), x3.stride(1),
            residual.stride(0) if residual is not None else 0, eps, H=heads, D=dim,
            HAS_RESIDUAL=residual is not None, BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=warps(block_h * block_d), **pdl_args(x.device),
        )
        # fmt: on
    return out if residual is None else (out, res_out)


# ---------------------------------------------------------------------------------------
# Rotary embedding ("rotate half": x * cos + [-x2, x1] * sin), q and k in one launch,
# optionally after Qwen3's per-head RMSNorm of q and k (q_norm, k_norm)
# ---------------------------------------------------------------------------------------


@triton.jit
def rope_rows(
    x_ptr,
    row_offs,
    rows_ok,
    pos,
    cos_ptr,
    sin_ptr,
    stride_cos,
    w_ptr,
    eps,
    offs_d,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Rows of head_dim D at x_ptr + row_offs (a [ROWS] tensor; rows_ok masks them), rotated
    for position `pos` (one for all rows, or [ROWS]: each row's own): [ROWS, BLOCK_D] float32
    holding values of x's dtype (0 past D). Each lane d reads x[d] and its rotate-half partner
    x[d +- D/2]: out = x c + sign x' s, sign -1 in the first half. With HAS_NORM, x is first
    w * x / rms(x) per row (Qwen3's q_norm, k_norm). Below float32, every product and the sum
    are rounded to x's dtype where the reference rounds; in float32, out is one fused
    multiply-add, which a compiler would otherwise contract or not depending on the variant."""
    half = D // 2
    d_ok = offs_d < D
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)  # [BLOCK_D]
    mask = rows_ok[:, None] & d_ok[None, :]
    x = tl.load(
        x_ptr + row_offs[:, None] + offs_d[None, :], mask=mask, other=0.0
    )  # [ROWS, BLOCK_D]
    dtype = x.dtype
    x = x.to(tl.float32)
    xs = tl.load(x_ptr + row_offs[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if (
        HAS_NORM
    ):  # the norm's output is the rotation's input: rounded to dtype, as between two layers
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [ROWS, 1]
        w = tl.load(w_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_D]
        ws = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = rounded(w * rounded(x * rstd, dtype), dtype)
        xs = rounded(ws * rounded(xs * rstd, dtype), dtype)
    # cos/sin tables are (positions, D) with both halves equal; rounded to the inputs' dtype
    # like the reference's `.to(q.dtype)`
    table = (pos * stride_cos + row_offs * 0)[:, None] + offs_d[None, :]  # [ROWS, BLOCK_D]
    c = rounded(tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32), dtype)
    s = rounded(tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32), dtype)
    sign = tl.where(offs_d < half, -1.0, 1.0)[None, :]
    if dtype == tl.float32:
        return tl.fma(x, c, sign * (xs * s))
    return rounded(rounded(x * c, dtype) + sign * rounded(xs * s, dtype), dtype)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_w_ptr,
    k_w_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    eps,
    QH: tl.constexpr,
    KH: tl.constexpr,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)  # one token: its q heads, then its k heads
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_ok = offs_d < D
    offs_qh = tl.arange(0, BLOCK_QH)  # [BLOCK_QH]
    # fmt: off
    q = rope_rows(
        q_ptr + t * stride_qt, offs_qh * stride_qh, offs_qh < QH, pos, cos_ptr, sin_ptr, stride_cos,
        q_w_ptr, eps, offs_d, D, HAS_NORM,
    )
    # fmt: on
    tl.store(
        q_out_ptr + (t * QH + offs_qh[:, None]) * D + offs_d[None, :],
        q.to(q_out_ptr.dtype.element_ty),
        mask=(offs_qh[:, None] < QH) & d_ok[None, :],
    )
    offs_kh = tl.arange(0, BLOCK_KH)
    # fmt: off
    k = rope_rows(
        k_ptr + t * stride_kt, offs_kh * stride_kh, offs_kh < KH, pos, cos_ptr, sin_ptr, stride_cos,
        k_w_ptr, eps, offs_d, D, HAS_NORM,
    )
    # fmt: on
    tl.store(
        k_out_ptr + (t * KH + offs_kh[:, None]) * D + offs_d[None, :],
        k.to(k_out_ptr.dtype.element_ty),
        mask=(offs_kh[:, None] < KH) & d_ok[None, :],
    )


def rotary(
    positions: torch.Tensor,  # (T,) int
    q: torch.Tensor,  # (T, heads, head_dim), last dim contiguous
    k: torch.Tensor,  # (T, kv_heads, head_dim), last dim contiguous
    cos: torch.Tensor,  # (max_positions, head_dim), both halves equal
    sin: torch.Tensor,  # (max_positions, head_dim)
    norm_weights: tuple[torch.Tensor, torch.Tensor]
    | None = None,  # q_norm's and k_norm's (head_dim,)
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
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=k.dtype, device=k.device),
    )
    if tokens > 0:
        block_qh = triton.next_power_of_2(q_heads)
        # fmt: off
        _rotary_kernel[(tokens,)](
            q, k, q_out, k_out, positions, cos, sin, q_w, k_w, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), cos.stride(0), eps, QH=q_heads, KH=k_heads, D=head_dim,
            HAS_NORM=norm_weights is not None, BLOCK_QH=block_qh,
            BLOCK_KH=triton.next_power_of_2(k_heads), BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=warps(block_qh * head_dim // 2), **pdl_args(q.device),
        )
        # fmt: on
    return q_out, k_out
