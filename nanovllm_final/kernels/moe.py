"""A mixture-of-experts layer's router and experts as Triton kernels (CUDA).

The router: one launch takes each token's softmax over the experts, its top_k and their
renormalised weights (fused_route), where the PyTorch reference (layers/moe.py,
route_torch) launches five kernels.

The experts as two grouped GEMMs: the (token, expert) pairs are grouped by expert and each
expert's run is padded to a multiple of BLOCK_M rows, so a block of rows belongs to one
expert. Then one launch multiplies every block by its expert's gate and up weights and
applies SiLU(gate) * up on the tile, and one launch multiplies by the down weights and
scales each row by its routing weight; the top_k rows of a token are summed at the end.
A few tokens (tuning's moe.small_pairs) take gemv.py's two matrix-vector kernels instead: each
(token, expert) pair is its own matrix-vector product for gate/up, reading its expert's
weights straight from the routing ids, and the down product takes all top_k pairs of a token
in one program and writes the token's weighted sum. Two launches, where the grouped path
costs eight (the ids' cast and four launches to group, two GEMMs, the sum).

Nothing reaches the host: the sort, the padding and all grids are sized from the shapes
(tokens, top_k, experts) alone, and blocks past the rows in use return at once, so a decode
step with these kernels can be captured in a CUDA graph. The reference is layers/moe.py's
route_torch and Experts.forward_loop; tests/test_moe_kernels.py checks these kernels against
it under TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

from . import tuning
from .common import rounded, swiglu
from .gemv import down_gemv_sum_kernel, gate_up_gemv_kernel
from .launch import pdl_args


@triton.jit
def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_lt,
    num_experts,  # logits: (T, E), last dim contiguous; weights, ids: (T, TOP_K) contiguous
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One token: the float32 softmax over its experts, the TOP_K largest probabilities in
    descending order (equal ones: the lowest expert first), renormalised by their float32 sum
    when RENORMALIZE, and only then cast to the weights' dtype, as route does."""
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_ok = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + offs_e, mask=e_ok, other=-float("inf")).to(
        tl.float32
    )
    exp = tl.exp(logits - tl.max(logits, 0))  # [BLOCK_E]; 0 past the experts
    probs = tl.where(e_ok, exp / tl.sum(exp, 0), -1.0)  # [BLOCK_E]; -1: never chosen
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K] slots
    top = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        expert = tl.min(tl.where(probs == best, offs_e, BLOCK_E), 0)
        expert = tl.minimum(expert, num_experts - 1)  # a NaN row still names a real expert
        top = tl.where(offs_k == slot, best, top)
        ids = tl.where(offs_k == slot, expert.to(tl.int64), ids)
        probs = tl.where(offs_e == expert, -1.0, probs)
    if RENORMALIZE:
        top = top / tl.sum(top, 0)  # the slots past TOP_K hold 0
    k_ok = offs_k < TOP_K
    tl.store(weights_ptr + token * TOP_K + offs_k, top.to(weights_ptr.dtype.element_ty), mask=k_ok)
    tl.store(ids_ptr + token * TOP_K + offs_k, ids, mask=k_ok)


def fused_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's route in one launch, one program per token: router_logits (T, E) ->
    weights (T, top_k) in router_logits' dtype, expert_ids (T, top_k) int64, heaviest first."""
    tokens, num_experts = router_logits.shape
    assert router_logits.stride(-1) == 1 and 0 < top_k <= num_experts
    weights = torch.empty(
        tokens, top_k, dtype=router_logits.dtype, device=router_logits.device
    )  # (T, top_k)
    expert_ids = torch.empty(
        tokens, top_k, dtype=torch.int64, device=router_logits.device
    )  # (T, top_k)
    if tokens == 0:
        return weights, expert_ids
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(tokens,)](
        router_logits,
        weights,
        expert_ids,
        router_logits.stride(0),
        num_experts,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=max(
            1, min(8, block_e // 256)
        ),  # a few experts per thread: the reductions stay in a warp
    )
    return weights, expert_ids


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rows_ptr, num_pairs, max_rows, BLOCK: tl.constexpr):
    """counts[e] += the pairs of this program's block that chose expert e; its block of rows
    is marked as padding until the scatter fills it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] pairs, and rows
    ok = offs < num_pairs
    tl.atomic_add(counts_ptr + tl.load(ids_ptr + offs, mask=ok, other=0), 1, mask=ok)
    tl.store(rows_ptr + offs, tl.full([BLOCK], 0, tl.int32) + num_pairs, mask=offs < max_rows)


@triton.jit
def _plan_kernel(
    counts_ptr,  # (E,) int32 in: pairs per expert; out: each expert's first row (the scatter's cursor)
    block_expert_ptr,
    num_rows_ptr,
    num_blocks,
    num_experts,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: pad each expert's run to whole blocks, lay the runs end to end and name the
    expert of every block."""
    offs_e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_ok = offs_e < num_experts
    padded = (
        (tl.load(counts_ptr + offs_e, mask=e_ok, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    )  # [BLOCK_E]
    ends = tl.cumsum(padded, 0)  # [BLOCK_E]: where each expert's run ends
    tl.store(counts_ptr + offs_e, ends - padded, mask=e_ok)
    tl.store(num_rows_ptr, tl.sum(padded, 0))
    for start in range(0, num_blocks, BLOCK):
        offs_b = start + tl.arange(0, BLOCK)  # [BLOCK] blocks
        # the expert of block b: how many runs end at or before its first row
        before = (ends[None, :] <= offs_b[:, None] * BLOCK_M) & e_ok[None, :]  # [BLOCK, BLOCK_E]
        expert = tl.minimum(tl.sum(before.to(tl.int32), 1), num_experts - 1)
        tl.store(block_expert_ptr + offs_b, expert, mask=offs_b < num_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, rows_ptr, num_pairs, BLOCK: tl.constexpr):
    """Each pair takes the next free row of its expert's run (the order inside a run is the
    atomics' and changes no result: every row is computed on its own)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] pairs
    ok = offs < num_pairs
    dest = tl.atomic_add(cursor_ptr + tl.load(ids_ptr + offs, mask=ok, other=0), 1, mask=ok)
    tl.store(rows_ptr + dest, offs, mask=ok)


def align_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_ids (tokens, top_k) -> (rows, block_expert, num_rows):
    rows (max_rows,) int32: the pair (token * top_k + slot) of each row, grouped by expert; tokens * top_k marks padding;
    block_expert (max_rows / block_m,) int32: the expert of each block of rows;
    num_rows (1,) int32: the rows in use. max_rows depends on the shapes only.
    Four launches: a memset, the count, the plan (one program), the scatter."""
    flat = expert_ids.flatten().to(torch.int32)  # (pairs,)
    pairs, device = flat.numel(), flat.device
    max_rows = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)  # (experts,)
    rows = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=device)
    num_rows = torch.empty(1, dtype=torch.int32, device=device)
    _count_kernel[(triton.cdiv(max_rows, 1024),)](flat, counts, rows, pairs, max_rows, BLOCK=1024)
    # fmt: off
    _plan_kernel[(1,)](
        counts, block_expert, num_rows, block_expert.numel(), num_experts, BLOCK_M=block_m,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK=128,
    )
    # fmt: on
    _scatter_kernel[(triton.cdiv(pairs, 1024),)](flat, counts, rows, pairs, BLOCK=1024)
    return rows, block_expert, num_rows


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    num_rows_ptr,
    stride_xt,
    stride_we,
    stride_wn,  # x: (T, K) rows; w: (E, 2N, K); last dims contiguous
    num_pairs,
    N,
    K,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    g_ptrs = (
        w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    )  # [BLOCK_K, BLOCK_N]
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
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, swiglu(acc_g, acc_u, dtype), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    rows_ptr,
    block_expert_ptr,
    num_rows_ptr,
    stride_we,
    stride_wn,  # h: (pairs, K) contiguous; w: (E, N, K), last dim contiguous
    num_pairs,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[pair] = routing_weight[pair] * (h[pair] @ down[e]^T) for one block of rows and N-columns."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(
        tl.int64
    )  # [BLOCK_M] pairs
    row_ok = rows < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * K + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = (
        w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    )  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(
            a,
            tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0),
            input_precision="ieee",
        )
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = rounded(acc, dtype) * weight[:, None]
    tl.store(
        out_ptr + rows[:, None] * N + offs_n[None, :],
        y.to(dtype),
        mask=row_ok[:, None] & n_ok[None, :],
    )


def _experts_gemv(x, gate_up, down, weights, expert_ids, tiles: dict) -> torch.Tensor:
    """The matrix-vector path of fused_experts: (tokens, hidden), each token's top_k outputs summed."""
    tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    tiles = dict(tiles)
    down_block_n, down_block_k = tiles.pop("DOWN_BLOCK_N"), tiles.pop("DOWN_BLOCK_K")
    ids = expert_ids.contiguous()
    inter = down.shape[2]
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)  # (pairs, inter)
    # fmt: off
    gate_up_gemv_kernel[(tokens * top_k, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, gate_up, ids, h, x.stride(0), gate_up.stride(0), gate_up.stride(1), inter, hidden,
        TOP_K=top_k, **tiles, **pdl_args(x.device),
    )
    # fmt: on
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)  # (tokens, hidden)
    # fmt: off
    down_gemv_sum_kernel[(tokens, triton.cdiv(hidden, down_block_n))](
        h, down, ids, weights.contiguous(), out, down.stride(0), down.stride(1), hidden, inter,
        TOP_K=top_k, BLOCK_S=triton.next_power_of_2(top_k),
        **{**tiles, "BLOCK_N": down_block_n, "BLOCK_K": down_block_k}, **pdl_args(x.device),
    )
    # fmt: on
    return out


def fused_experts(
    x: torch.Tensor,  # (T, hidden), last dim contiguous
    gate_up: torch.Tensor,  # (E, 2 * inter, hidden): each expert's [gate | up] rows
    down: torch.Tensor,  # (E, hidden, inter)
    weights: torch.Tensor,  # (T, top_k) routing weights
    expert_ids: torch.Tensor,  # (T, top_k)
    block_m: int | None = None,
    tiles: dict | None = None,
    small: bool | None = None,  # the matrix-vector path; None: up to the device's moe.small_pairs
) -> torch.Tensor:
    """sum over each token's top_k experts e of weight * down[e] @ (silu(gate[e] @ x) * (up[e] @ x)):
    (T, hidden). `tiles` overrides the launch's tile sizes (tuning's moe.gemv or moe.grouped, by
    path)."""
    tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    top_k = expert_ids.shape[1]
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    assert gate_up.shape == (num_experts, 2 * inter, hidden)
    assert down.shape == (num_experts, hidden, inter)
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    choices = tuning.for_device(x.device)
    if small if small is not None else pairs <= choices.moe_small_pairs:
        gemv_tiles = {**choices.moe_gemv(), **(tiles or {})}
        return _experts_gemv(x, gate_up, down, weights, expert_ids, gemv_tiles)
    # few rows per expert (decode): small blocks
    block_m = block_m or (16 if pairs <= 16 * num_experts else 64)
    rows, block_expert, num_rows = align_by_expert(expert_ids, num_experts, block_m)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # (pairs, inter)
    # BLOCK_N, BLOCK_K and the launch's num_warps, num_stages
    tiles = {**choices.moe_grouped(pairs), **(tiles or {})}
    block_n = tiles["BLOCK_N"]
    # a stage of the gate/up kernel: x's (BLOCK_M, BLOCK_K) and gate's and up's (BLOCK_K, BLOCK_N)
    stage_bytes = x.element_size() * tiles["BLOCK_K"] * (block_m + 2 * block_n)
    tiles = tuning.fit_stages(tiles, stage_bytes, x.device)
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # (pairs, hidden)
    # fmt: off
    _gate_up_kernel[(block_expert.numel(), triton.cdiv(inter, block_n))](
        x, gate_up, h, rows, block_expert, num_rows,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), pairs, inter, hidden,
        TOP_K=top_k, BLOCK_M=block_m, **tiles,
    )
    _down_kernel[(block_expert.numel(), triton.cdiv(hidden, block_n))](
        h, down, weights.contiguous(), out, rows, block_expert, num_rows,
        down.stride(0), down.stride(1), pairs, hidden, inter,
        BLOCK_M=block_m, **tiles,
    )
    # fmt: on
    return out.view(tokens, top_k, hidden).sum(dim=1)  # (T, hidden)
