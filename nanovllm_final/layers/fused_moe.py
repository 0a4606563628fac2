"""The experts of a mixture-of-experts layer as two grouped GEMMs (CUDA; Triton).

The (token, expert) pairs are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M rows, so a block of rows belongs to one expert. Then one launch
multiplies every block by its expert's gate and up weights and applies SiLU(gate) * up on
the tile, and one launch multiplies by the down weights and scales each row by its routing
weight; the top_k rows of a token are summed at the end.

Nothing reaches the host: the sort, the padding and both grids are sized from the shapes
(tokens, top_k, experts) alone, and blocks past the rows in use return at once, so a decode
step with this path can be captured in a CUDA graph. layers/moe.py's loop over the experts
is the reference; tests/test_moe_kernels.py checks these kernels against it under
TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

from .fused_triton import _rounded

TILES = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}  # benchmarks/moe_layer_bench.py compares others


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids (tokens, top_k) -> (rows, block_expert, num_rows):
    rows (max_rows,) int32: the pair (token * top_k + slot) of each sorted row; tokens * top_k marks padding;
    block_expert (max_rows / block_m,) int32: the expert of each block of rows;
    num_rows (1,) int32: the rows in use. max_rows depends on the shapes only."""
    flat = expert_ids.flatten()  # (pairs,)
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))  # (experts,)
    padded = (counts + block_m - 1) // block_m * block_m  # (experts,)
    ends = padded.cumsum(0)  # (experts,): where each expert's run of rows ends
    sorted_experts, order = flat.sort(stable=True)  # (pairs,) each
    first = counts.cumsum(0) - counts  # (experts,): each expert's first place in `order`
    dest = (ends - padded)[sorted_experts] + torch.arange(pairs, device=device) - first[sorted_experts]  # (pairs,)
    max_rows = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    rows = torch.full((max_rows,), pairs, dtype=torch.int32, device=device).scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_rows, block_m, device=device)  # (blocks,)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return rows, block_expert, ends[-1:].to(torch.int32)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, num_rows_ptr,
    stride_xt, stride_we, stride_wn,  # x: (T, K) rows; w: (E, 2N, K); last dims contiguous
    num_pairs, N, K,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair] = silu(x[token] @ gate[e]^T) * (x[token] @ up[e]^T) for one block of rows and N-columns."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] pairs
    row_ok = rows < num_pairs
    tokens = (rows // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + N * stride_wn  # the up rows follow the gate rows
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        acc_g += tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), input_precision="ieee")
        acc_u += tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), input_precision="ieee")
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    # rounded where the reference rounds: the projections, silu(gate), the product
    gate, up = _rounded(acc_g, dtype), _rounded(acc_u, dtype)
    act = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, (act * up).to(dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, weights_ptr, out_ptr, rows_ptr, block_expert_ptr, num_rows_ptr,
    stride_we, stride_wn,  # h: (pairs, K) contiguous; w: (E, N, K), last dim contiguous
    num_pairs, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair] = routing_weight[pair] * (h[pair] @ down[e]^T) for one block of rows and N-columns."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M] pairs
    row_ok = rows < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * K + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0), input_precision="ieee")
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = _rounded(acc, dtype) * weight[:, None]
    tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], y.to(dtype), mask=row_ok[:, None] & n_ok[None, :])


def fused_experts(
    x: torch.Tensor,  # (T, hidden), last dim contiguous
    gate_up: torch.Tensor,  # (E, 2 * inter, hidden): each expert's [gate | up] rows
    down: torch.Tensor,  # (E, hidden, inter)
    weights: torch.Tensor,  # (T, top_k) routing weights
    expert_ids: torch.Tensor,  # (T, top_k)
    block_m: int | None = None,
    tiles: dict | None = None,
) -> torch.Tensor:
    """sum over each token's top_k experts e of weight * down[e] @ (silu(gate[e] @ x) * (up[e] @ x)): (T, hidden)."""
    tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    top_k = expert_ids.shape[1]
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    assert gate_up.shape == (num_experts, 2 * inter, hidden) and down.shape == (num_experts, hidden, inter)
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    block_m = block_m or (16 if pairs <= 16 * num_experts else 64)  # few rows per expert (decode): small blocks
    rows, block_expert, num_rows = align_by_expert(expert_ids, num_experts, block_m)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # (pairs, inter)
    tiles = {**TILES, **(tiles or {})}  # BLOCK_N, BLOCK_K and the launch's num_warps, num_stages
    block_n = tiles["BLOCK_N"]
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, block_n))](
        x, gate_up, h, rows, block_expert, num_rows,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        pairs, inter, hidden,
        TOP_K=top_k, BLOCK_M=block_m, **tiles,
    )
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # (pairs, hidden)
    _down_kernel[(block_expert.numel(), triton.cdiv(hidden, block_n))](
        h, down, weights.contiguous(), out, rows, block_expert, num_rows,
        down.stride(0), down.stride(1),
        pairs, hidden, inter,
        BLOCK_M=block_m, **tiles,
    )
    return out.view(tokens, top_k, hidden).sum(dim=1)  # (T, hidden)
