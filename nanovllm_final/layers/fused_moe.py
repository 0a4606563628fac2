"""A mixture-of-experts layer's router and experts as Triton kernels (CUDA).

The router: one launch takes each token's softmax over the experts, its top_k and their
renormalised weights (fused_route), where the PyTorch reference (layers/moe.py,
route_torch) launches five kernels.

The experts as two grouped GEMMs: the (token, expert) pairs are grouped by expert and each
expert's run is padded to a multiple of BLOCK_M rows, so a block of rows belongs to one
expert. Then one launch multiplies every block by its expert's gate and up weights and
applies SiLU(gate) * up on the tile, and one launch multiplies by the down weights and
scales each row by its routing weight; the top_k rows of a token are summed at the end.
A few tokens (SMALL_PAIRS) take two matrix-vector kernels instead, the second of which sums
each token's top_k outputs itself; they serve a dense layer's few rows too (dense_mlp, gemv).

Nothing reaches the host: the sort, the padding and all grids are sized from the shapes
(tokens, top_k, experts) alone, and blocks past the rows in use return at once, so a decode
step with these kernels can be captured in a CUDA graph. layers/moe.py's torch code is the
reference; tests/test_moe_kernels.py checks these kernels against it under
TRITON_INTERPRET=1."""

import torch
import triton
import triton.language as tl

from .fused_triton import _rounded
from .launch import pdl_args, wait_for_prior_kernel


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    stride_lt, num_experts,  # logits: (T, E), last dim contiguous; weights, ids: (T, TOP_K) contiguous
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One token: the float32 softmax over its experts, the TOP_K largest probabilities in
    descending order (equal ones: the lowest expert first), renormalised by their float32 sum
    when RENORMALIZE, and only then cast to the weights' dtype, as route does."""
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_ok = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + offs_e, mask=e_ok, other=-float("inf")).to(tl.float32)
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


def fused_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's route in one launch, one program per token: router_logits (T, E) ->
    weights (T, top_k) in router_logits' dtype, expert_ids (T, top_k) int64, heaviest first."""
    tokens, num_experts = router_logits.shape
    assert router_logits.stride(-1) == 1 and 0 < top_k <= num_experts
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)  # (T, top_k)
    expert_ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)  # (T, top_k)
    if tokens == 0:
        return weights, expert_ids
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(tokens,)](
        router_logits, weights, expert_ids, router_logits.stride(0), num_experts,
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=max(1, min(8, block_e // 256)),  # a few experts per thread: the reductions stay in a warp
    )
    return weights, expert_ids


def default_tiles(pairs: int) -> dict:
    """The grouped GEMMs' tiles by (token, expert) pairs: the fastest of benchmarks/moe_layer_bench.py's
    choices on an H200 for Qwen3-30B-A3B's experts (results/moe_layer_qwen3-30b-a3b_h200.json)."""
    if pairs <= 2048:  # decode batches up to 256 tokens: deeper K tiles
        return {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if pairs <= 8192:
        return {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


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
    block_expert_ptr, num_rows_ptr, num_blocks, num_experts,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program: pad each expert's run to whole blocks, lay the runs end to end and name the
    expert of every block."""
    offs_e = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    e_ok = offs_e < num_experts
    padded = (tl.load(counts_ptr + offs_e, mask=e_ok, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BLOCK_E]
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


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    _plan_kernel[(1,)](counts, block_expert, num_rows, block_expert.numel(), num_experts,
                       BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK=128)
    _scatter_kernel[(triton.cdiv(pairs, 1024),)](flat, counts, rows, pairs, BLOCK=1024)
    return rows, block_expert, num_rows


@triton.jit
def _swiglu(acc_g, acc_u, dtype: tl.constexpr):
    """silu(gate) * up from the float32 projections, rounded to `dtype` where the reference
    rounds: the projections, silu(gate), the product."""
    gate, up = _rounded(acc_g, dtype), _rounded(acc_u, dtype)
    act = _rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    return (act * up).to(dtype)


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
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, _swiglu(acc_g, acc_u, dtype), mask=row_ok[:, None] & n_ok[None, :])


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


# A few tokens (a small decode batch): no grouping at all. Each (token, expert) pair is its own
# matrix-vector product for gate/up, one program per pair and block of columns reading its
# expert's weights straight from the routing ids; the down product takes all top_k pairs of a
# token in one program and writes the token's weighted sum. Two launches, where the grouped
# path costs eight (the ids' cast and four launches to group, two GEMMs, the sum).
# The same kernels serve dense layers at a decode batch of a few rows (ROUTED=False: one
# expert that every token picks with weight 1): `dense_mlp` is a whole SwiGLU MLP in two
# launches, `gemv` any projection without a bias, where cuBLAS picks kernels far from the
# memory bound at one row.
SMALL_PAIRS = 64  # at most this many pairs take the matrix-vector path (faster up to 8 tokens of top-8 on an H200)
GEMV_ROWS = 2  # dense layers: at most this many rows (each program reads the weights for one row); on an
# H200 faster than cuBLAS at 1 and 2 rows, slower at 4 (results/dense_gemv_decode_latency_qwen3-0.6b_h200.json)
# BLOCK_N, BLOCK_K: gate/up's columns and K tile per program; DOWN_BLOCK_N, DOWN_BLOCK_K the down
# kernel's (fewer columns, as each of its programs reads the rows of top_k experts); num_warps both.
GEMV_TILES = {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "DOWN_BLOCK_N": 2, "DOWN_BLOCK_K": 256}
# The dense path's tiles (columns x K, warps), one per projection kind: gemv's for qkv and o, dense_mlp's
# for its gate/up (dense_gate_up) and its down. benchmarks/gemv_bench.py times each projection alone for
# every tile choice (results/gemv_tiles_h200.json): on an H200, 2x1024 with 2 warps is the fastest for qkv
# at one and two rows on both shapes measured, 1x1024 with 2 warps for gate/up, 2x4096 with 4 warps for
# down (one K tile: a program reads whole rows); the Qwen3-0.6B batch-1 step with them is
# results/decode_latency_qwen3-0.6b_final_h200.json.
DENSE_GEMV_TILES = {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 2}
DENSE_GATE_UP_TILES = {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 2}
DENSE_DOWN_TILES = {"BLOCK_N": 2, "BLOCK_K": 4096, "num_warps": 4}


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w_ptr, ids_ptr, out_ptr,
    stride_xt, stride_we, stride_wn,  # x: (T, K); w: (E, 2N, K); last dims contiguous
    N, K,
    TOP_K: tl.constexpr, ROUTED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
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
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
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
    tl.store(out_ptr + pair.to(tl.int64) * N + offs_n, _swiglu(acc_g, acc_u, out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_gemv_sum_kernel(
    h_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr,
    stride_we, stride_wn,  # h: (pairs, K) contiguous; w: (E, N, K), last dim contiguous; out: (T, N) contiguous
    N, K,
    TOP_K: tl.constexpr, ROUTED: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
        routing = tl.load(weights_ptr + pairs, mask=s_ok, other=0.0).to(tl.float32)  # [BLOCK_S]; 0 past TOP_K
    else:
        experts = tl.zeros([BLOCK_S], dtype=tl.int64)
        routing = tl.where(s_ok, 1.0, 0.0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    b_ptrs = (w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :])  # [BLOCK_S, BLOCK_N, BLOCK_K]
    h_ptrs = h_ptr + pairs[:, None] * K + offs_k[None, :]  # [BLOCK_S, BLOCK_K]
    sn_ok = s_ok[:, None] & n_ok[None, :]  # [BLOCK_S, BLOCK_N]
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(h_ptrs, mask=s_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_S, BLOCK_K]
        b = tl.load(b_ptrs, mask=sn_ok[:, :, None] & k_ok[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * a[:, None, :], axis=2)  # [BLOCK_S, BLOCK_N]
        h_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    per_pair = _rounded(_rounded(acc, dtype) * routing[:, None], dtype)  # [BLOCK_S, BLOCK_N]
    tl.store(out_ptr + token * N + offs_n, tl.sum(per_pair, axis=0).to(dtype), mask=n_ok)


def _experts_gemv(x, gate_up, down, weights, expert_ids, tiles: dict) -> torch.Tensor:
    """The matrix-vector path of fused_experts: (tokens, hidden), each token's top_k outputs summed."""
    tokens, hidden = x.shape
    top_k = expert_ids.shape[1]
    tiles = dict(tiles)
    down_block_n, down_block_k = tiles.pop("DOWN_BLOCK_N"), tiles.pop("DOWN_BLOCK_K")
    ids = expert_ids.contiguous()
    inter = down.shape[2]
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)  # (pairs, inter)
    _gate_up_gemv_kernel[(tokens * top_k, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, gate_up, ids, h, x.stride(0), gate_up.stride(0), gate_up.stride(1), inter, hidden,
        TOP_K=top_k, ROUTED=True, **tiles, **pdl_args(x.device))
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)  # (tokens, hidden)
    _down_gemv_sum_kernel[(tokens, triton.cdiv(hidden, down_block_n))](
        h, down, ids, weights.contiguous(), out, down.stride(0), down.stride(1), hidden, inter,
        TOP_K=top_k, ROUTED=True, BLOCK_S=triton.next_power_of_2(top_k),
        **{**tiles, "BLOCK_N": down_block_n, "BLOCK_K": down_block_k}, **pdl_args(x.device))
    return out


def dense_gate_up(x: torch.Tensor, gate_up: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """silu(gate @ x) * (up @ x) for a few rows (at most GEMV_ROWS) in one launch: x (T, hidden),
    gate_up (2 * inter, hidden) = [gate | up] rows -> (T, inter). tiles: DENSE_GATE_UP_TILES by default."""
    assert x.is_contiguous() and gate_up.is_contiguous()
    tiles = tiles or DENSE_GATE_UP_TILES
    tokens, k = x.shape
    inter = gate_up.shape[0] // 2
    h = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)  # (T, inter)
    if tokens:
        _gate_up_gemv_kernel[(tokens, triton.cdiv(inter, tiles["BLOCK_N"]))](
            x, gate_up, x, h, x.stride(0), 0, gate_up.stride(0), inter, k, TOP_K=1, ROUTED=False, **tiles, **pdl_args(x.device))
    return h


def dense_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP for a few rows (at most GEMV_ROWS) in two launches: x (T, hidden), gate_up
    (2 * inter, hidden), down (hidden, inter) -> down @ (silu(gate @ x) * (up @ x)), (T, hidden)."""
    return gemv(dense_gate_up(x, gate_up), down, DENSE_DOWN_TILES)


def gemv(x: torch.Tensor, w: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """x @ w^T for a few rows (at most GEMV_ROWS), rounded once as F.linear: x (T, K) contiguous,
    w (N, K) with a contiguous last dim -> (T, N). The down kernel with one expert of weight 1;
    tiles (BLOCK_N, BLOCK_K, num_warps): DENSE_GEMV_TILES by default."""
    tokens, k = x.shape
    n = w.shape[0]
    assert x.is_contiguous() and w.stride(-1) == 1 and w.shape[1] == k
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)  # (T, N)
    if tokens:
        tiles = tiles or DENSE_GEMV_TILES
        _down_gemv_sum_kernel[(tokens, triton.cdiv(n, tiles["BLOCK_N"]))](
            x, w, x, x, out, 0, w.stride(0), n, k, TOP_K=1, ROUTED=False, BLOCK_S=1, **tiles, **pdl_args(x.device))
    return out


def fused_experts(
    x: torch.Tensor,  # (T, hidden), last dim contiguous
    gate_up: torch.Tensor,  # (E, 2 * inter, hidden): each expert's [gate | up] rows
    down: torch.Tensor,  # (E, hidden, inter)
    weights: torch.Tensor,  # (T, top_k) routing weights
    expert_ids: torch.Tensor,  # (T, top_k)
    block_m: int | None = None,
    tiles: dict | None = None,
    small: bool | None = None,  # the matrix-vector path; None: when there are at most SMALL_PAIRS pairs
) -> torch.Tensor:
    """sum over each token's top_k experts e of weight * down[e] @ (silu(gate[e] @ x) * (up[e] @ x)): (T, hidden).
    `tiles` overrides the launch's tile sizes (GEMV_TILES or default_tiles, by path)."""
    tokens, hidden = x.shape
    num_experts, inter = down.shape[0], down.shape[2]
    top_k = expert_ids.shape[1]
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    assert gate_up.shape == (num_experts, 2 * inter, hidden) and down.shape == (num_experts, hidden, inter)
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    if small if small is not None else pairs <= SMALL_PAIRS:
        return _experts_gemv(x, gate_up, down, weights, expert_ids, {**GEMV_TILES, **(tiles or {})})
    block_m = block_m or (16 if pairs <= 16 * num_experts else 64)  # few rows per expert (decode): small blocks
    rows, block_expert, num_rows = align_by_expert(expert_ids, num_experts, block_m)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # (pairs, inter)
    tiles = {**default_tiles(pairs), **(tiles or {})}  # BLOCK_N, BLOCK_K and the launch's num_warps, num_stages
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
