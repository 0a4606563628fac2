"""Matrix-vector products in Triton: a few rows times a weight matrix, at the memory bound.

Two kernels: `_gate_up_gemv_kernel` computes silu(gate @ x) * (up @ x) for one row and block
of columns, `_down_gemv_sum_kernel` a projection, summing over each token's top_k slots. With
ROUTED=False they serve dense layers at a decode batch of a few rows (one expert that every
token picks with weight 1): `dense_mlp` is a whole SwiGLU MLP in two launches, `gemv` any
projection without a bias, where cuBLAS picks kernels far from the memory bound at one row.
With ROUTED=True, moe.py runs a few tokens' experts on them. References: F.linear, and
layers/transformer.py's MLP (SiluAndMul between two projections); tests/test_moe_kernels.py
checks them against those under TRITON_INTERPRET=1. Tiles: tuning.py's `gemv` entry."""

import torch
import triton
import triton.language as tl

from . import tuning
from .common import rounded, swiglu
from .launch import pdl_args, wait_for_prior_kernel


@triton.jit
def gate_up_gemv_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    stride_xt,
    stride_we,
    stride_wn,  # x: (T, K); w: (E, 2N, K); last dims contiguous
    N,
    K,
    TOP_K: tl.constexpr,
    ROUTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[pair, n-block] = silu(gate[e] @ x[token]) * (up[e] @ x[token]) for one pair
    (ROUTED=False: expert 0, a dense MLP's weights)."""
    wait_for_prior_kernel(PDL)
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
    expert = 0
    if ROUTED:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    g_ptrs = (
        w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    )  # [BLOCK_N, BLOCK_K]
    u_ptrs = g_ptrs + N * stride_wn  # the up rows follow the gate rows
    x_ptrs = x_ptr + token * stride_xt + offs_k  # [BLOCK_K]
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_K]
        w_mask = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.sum(tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
        acc_u += tl.sum(tl.load(u_ptrs, mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    tl.store(
        out_ptr + pair.to(tl.int64) * N + offs_n,
        swiglu(acc_g, acc_u, out_ptr.dtype.element_ty),
        mask=n_ok,
    )


@triton.jit
def down_gemv_sum_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    stride_we,
    stride_wn,  # h: (pairs, K) contiguous; w: (E, N, K), last dim contiguous; out: (T, N) contiguous
    N,
    K,
    TOP_K: tl.constexpr,
    ROUTED: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, n-block] = sum over the token's top_k slots of routing_weight * (down[e] @ h[pair]).
    Each pair's product is rounded to the output dtype, scaled and rounded again, as a
    (pairs, N) buffer would hold it; the sum is float32, rounded once. ROUTED=False: one slot,
    expert 0 with weight 1, i.e. out = h @ w[0]^T rounded once, as F.linear."""
    wait_for_prior_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S] slots
    s_ok = offs_s < TOP_K
    pairs = token * TOP_K + offs_s  # [BLOCK_S]
    if ROUTED:
        experts = tl.load(ids_ptr + pairs, mask=s_ok, other=0).to(tl.int64)  # [BLOCK_S]
        routing = tl.load(weights_ptr + pairs, mask=s_ok, other=0.0).to(
            tl.float32
        )  # [BLOCK_S]; 0 past TOP_K
    else:
        experts = tl.zeros([BLOCK_S], dtype=tl.int64)
        routing = tl.where(s_ok, 1.0, 0.0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    b_ptrs = (
        w_ptr
        + experts[:, None, None] * stride_we
        + offs_n[None, :, None].to(tl.int64) * stride_wn
        + offs_k[None, None, :]
    )  # [BLOCK_S, BLOCK_N, BLOCK_K]
    h_ptrs = h_ptr + pairs[:, None] * K + offs_k[None, :]  # [BLOCK_S, BLOCK_K]
    sn_ok = s_ok[:, None] & n_ok[None, :]  # [BLOCK_S, BLOCK_N]
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(h_ptrs, mask=s_ok[:, None] & k_ok[None, :], other=0.0).to(
            tl.float32
        )  # [BLOCK_S, BLOCK_K]
        b = tl.load(b_ptrs, mask=sn_ok[:, :, None] & k_ok[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * a[:, None, :], axis=2)  # [BLOCK_S, BLOCK_N]
        h_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    per_pair = rounded(rounded(acc, dtype) * routing[:, None], dtype)  # [BLOCK_S, BLOCK_N]
    tl.store(out_ptr + token * N + offs_n, tl.sum(per_pair, axis=0).to(dtype), mask=n_ok)


def dense_gate_up(
    x: torch.Tensor, gate_up: torch.Tensor, tiles: dict | None = None
) -> torch.Tensor:
    """silu(gate @ x) * (up @ x) for a few rows in one launch: x (T, hidden), gate_up
    (2 * inter, hidden) = [gate | up] rows -> (T, inter). tiles: the device's gemv gate_up by default."""
    assert x.is_contiguous() and gate_up.is_contiguous()
    tiles = tiles or tuning.for_device(x.device).gemv("gate_up")
    tokens, k = x.shape
    inter = gate_up.shape[0] // 2
    h = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)  # (T, inter)
    if tokens:
        # fmt: off
        gate_up_gemv_kernel[(tokens, triton.cdiv(inter, tiles["BLOCK_N"]))](
            x, gate_up, x, h, x.stride(0), 0, gate_up.stride(0), inter, k, TOP_K=1, ROUTED=False,
            **tiles, **pdl_args(x.device),
        )
        # fmt: on
    return h


def dense_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP for a few rows in two launches: x (T, hidden), gate_up (2 * inter, hidden),
    down (hidden, inter) -> down @ (silu(gate @ x) * (up @ x)), (T, hidden)."""
    return gemv(dense_gate_up(x, gate_up), down, tuning.for_device(x.device).gemv("down"))


def gemv(x: torch.Tensor, w: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """x @ w^T for a few rows, rounded once as F.linear: x (T, K) contiguous, w (N, K) with a
    contiguous last dim -> (T, N). The down kernel with one expert of weight 1; tiles (BLOCK_N,
    BLOCK_K, num_warps): the device's gemv linear by default."""
    tokens, k = x.shape
    n = w.shape[0]
    assert x.is_contiguous() and w.stride(-1) == 1 and w.shape[1] == k
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)  # (T, N)
    if tokens:
        tiles = tiles or tuning.for_device(x.device).gemv("linear")
        # fmt: off
        down_gemv_sum_kernel[(tokens, triton.cdiv(n, tiles["BLOCK_N"]))](
            x, w, x, x, out, 0, w.stride(0), n, k, TOP_K=1, ROUTED=False, BLOCK_S=1, **tiles,
            **pdl_args(x.device),
        )
        # fmt: on
    return out
