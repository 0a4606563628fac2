"""Matrix-vector products in Triton: a few rows times a weight matrix, at the memory bound.

Dense layers at a few rows (a small decode batch, a verify step), where cuBLAS picks kernels far
from the memory bound: `gemv` is any projection without a bias, `dense_gate_up` a SwiGLU MLP's
gate and up projections with the activation on the tile. Two kernels, both reading each weight
tile once for all of a program's rows: `dense_gemv_kernel` multiplies the rows in turn,
`dense_dot_kernel` all at once on tensor cores, padded to 16 (the row loop's arithmetic grows
with each row, the padded product's does not), its K split over several programs where its
output tiles alone would leave SMs idle (the tiles' SPLIT_K, `split_k`). Which takes how many
rows is each projection kind's (linear, gate_up, down) tuning: the row loop up to its gemv rows,
the product up to its dot_rows, cuBLAS past both. In either a row's result does not depend on
which rows share the launch. `gate_up_gemv_kernel` and `down_gemv_sum_kernel` run a few tokens'
experts for moe.py, each (token, expert) pair reading its own expert's weights. References:
F.linear, and layers/transformer.py's MLP (SiluAndMul between two projections);
tests/test_moe_kernels.py checks them against those under TRITON_INTERPRET=1. Tiles: tuning.py's
`gemv` entry (and `moe.gemv`)."""

import torch
import triton
import triton.language as tl

from . import tuning
from .common import SplitCounters, rounded, swiglu
from .launch import pdl_args, wait_for_prior_kernel


@triton.jit
def dense_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_xt,
    stride_wn,  # x: (T, K); w: (N, K), or (2N, K) = [gate | up] with GATE_UP; last dims contiguous
    T,
    N,
    K,
    GATE_UP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    ROWS: tl.constexpr,  # min(T, BLOCK_T): the rows a program may hold; the padding is skipped
):
    """out[t-block, n-block] = x @ w^T rounded once as F.linear, or with GATE_UP
    silu(x @ gate^T) * (x @ up^T), for BLOCK_T rows: each weight tile is loaded once, then
    every row is multiplied by it in turn (ROWS of them: 5 rows pad to a block of 8, whose last
    3 would only multiply zeros)."""
    wait_for_prior_kernel(PDL)
    row0 = tl.program_id(0) * BLOCK_T
    offs_t = row0 + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    g_ptrs = (
        w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    )  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + row0.to(tl.int64) * stride_xt + offs_k  # [BLOCK_K], row0's
    acc_g = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        w_mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if GATE_UP:  # the up rows follow the gate rows
            u = tl.load(g_ptrs + N * stride_wn, mask=w_mask, other=0.0).to(tl.float32)
        for t in tl.static_range(ROWS):
            k_left = tl.where(row0 + t < T, K - k * BLOCK_K, 0)  # none past the last row
            a = tl.load(x_ptrs + t * stride_xt, mask=offs_k < k_left, other=0.0)
            a = a.to(tl.float32)[None, :]  # [1, BLOCK_K]
            mine = (offs_t == row0 + t)[:, None]  # [BLOCK_T, 1]: row t's accumulators
            acc_g = tl.where(mine, acc_g + tl.sum(g * a, axis=1)[None, :], acc_g)
            if GATE_UP:
                acc_u = tl.where(mine, acc_u + tl.sum(u * a, axis=1)[None, :], acc_u)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    out = swiglu(acc_g, acc_u, dtype) if GATE_UP else acc_g.to(dtype)  # [BLOCK_T, BLOCK_N]
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, out, mask=(offs_t < T)[:, None] & n_ok[None, :])


@triton.jit
def dense_dot_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    stride_xt,
    stride_wn,  # x: (T, K); w: (N, K), or (2N, K) = [gate | up] with GATE_UP; last dims contiguous
    T,
    N,
    K,
    GATE_UP: tl.constexpr,
    BLOCK_T: tl.constexpr,  # 16: the smallest tile a tensor-core product takes
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per output tile, each over its share of K's tiles
    part_ptr,  # (SPLIT_K, T padded to BLOCK_T, N, or 2N with GATE_UP) float32: SPLIT_K > 1 only
    count_ptr,  # (t-blocks * n-blocks,) int32, zero between launches: SPLIT_K > 1 only
):
    """dense_gemv_kernel's product on tensor cores: the rows padded to BLOCK_T, each weight tile
    loaded once and multiplied with all of them in one tl.dot. The padding costs no weight bytes,
    and the arithmetic does not grow with the rows as the row loop's does (which kernel is faster
    at how many rows is the tuner's to say). A row's result does not depend on the rows beside it
    (the padding is zeros, each output element sums its K in the same order).

    Split-K: an output of few tiles (1024 outputs are 32 programs of 32) would leave most SMs
    without a share of the weights to stream, so SPLIT_K programs each take a contiguous share
    of K's tiles and store their float32 sums in `part_ptr`; the last of them to finish (a
    counter per output tile) adds the SPLIT_K sums in split order, writes the output and resets
    the counter for the next launch. The order is fixed, so the result does not depend on which
    program finishes last."""
    wait_for_prior_kernel(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    t_ok, n_ok = offs_t < T, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    k_tiles = tl.cdiv(K, BLOCK_K)
    share = tl.cdiv(k_tiles, SPLIT_K)  # K's tiles per split; the last split may get fewer (or none)
    k_first = tl.program_id(2) * share
    x_ptrs = (
        x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :] + k_first * BLOCK_K
    )  # [BLOCK_T, BLOCK_K]
    g_ptrs = (
        w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] + k_first * BLOCK_K
    )  # [BLOCK_K, BLOCK_N]: w^T's tile
    acc_g = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, tl.minimum(k_first + share, k_tiles)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=t_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
        w_mask = k_ok[:, None] & n_ok[None, :]
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, input_precision="ieee")
        if GATE_UP:  # the up rows follow the gate rows
            u = tl.load(g_ptrs + N * stride_wn, mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + offs_t[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT_K == 1:
        out = swiglu(acc_g, acc_u, dtype) if GATE_UP else acc_g.to(dtype)  # [BLOCK_T, BLOCK_N]
        tl.store(out_ptrs, out, mask=t_ok[:, None] & n_ok[None, :])
    else:
        width = 2 * N if GATE_UP else N  # a row of parts: the gate's sums, then the up's
        rows_padded = tl.num_programs(0) * BLOCK_T
        part_ptrs = part_ptr + offs_t[:, None].to(tl.int64) * width + offs_n[None, :]
        split_stride = rows_padded.to(tl.int64) * width  # one split's parts
        own = part_ptrs + tl.program_id(2) * split_stride  # [BLOCK_T, BLOCK_N]
        tl.store(own, acc_g, mask=n_ok[None, :])
        if GATE_UP:
            tl.store(own + N, acc_u, mask=n_ok[None, :])
        tl.debug_barrier()  # every thread's parts stored before the counter says so
        counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:  # the last split here
            acc_g = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # in split order, wherever the last one ran
                ptrs = part_ptrs + s * split_stride
                acc_g += tl.load(ptrs, mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
                if GATE_UP:
                    acc_u += tl.load(ptrs + N, mask=n_ok[None, :], other=0.0, cache_modifier=".cg")
            out = swiglu(acc_g, acc_u, dtype) if GATE_UP else acc_g.to(dtype)  # [BLOCK_T, BLOCK_N]
            tl.store(out_ptrs, out, mask=t_ok[:, None] & n_ok[None, :])
            tl.atomic_xchg(counter, 0)  # ready for the next launch


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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[pair, n-block] = silu(gate[e] @ x[token]) * (up[e] @ x[token]) for one (token,
    expert) pair, e its routed expert."""
    wait_for_prior_kernel(PDL)
    pair = tl.program_id(0)
    token = (pair // TOP_K).to(tl.int64)
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
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, n-block] = sum over the token's top_k slots of routing_weight * (down[e] @ h[pair]).
    Each pair's product is rounded to the output dtype, scaled and rounded again, as a
    (pairs, N) buffer would hold it; the sum is float32, rounded once."""
    wait_for_prior_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S] slots
    s_ok = offs_s < TOP_K
    pairs = token * TOP_K + offs_s  # [BLOCK_S]
    experts = tl.load(ids_ptr + pairs, mask=s_ok, other=0).to(tl.int64)  # [BLOCK_S]
    routing = tl.load(weights_ptr + pairs, mask=s_ok, other=0.0).to(tl.float32)  # 0 past TOP_K
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


def _dense(
    x: torch.Tensor, w: torch.Tensor, n: int, gate_up: bool, tiles: dict, dot: bool
) -> torch.Tensor:
    """One launch: x (T, K) contiguous, w (N or 2N, K) -> (T, N). The row loop
    (dense_gemv_kernel) holds every row in one program column (up to 8 rows a program: more
    would spill registers); the tensor-core product (`dot`, dense_dot_kernel) 16 rows a program."""
    tokens, k = x.shape
    assert x.is_contiguous() and w.stride(-1) == 1 and w.shape[1] == k
    out = torch.empty(tokens, n, dtype=x.dtype, device=x.device)  # (T, N)
    if not tokens:
        return out
    block_t = 16 if dot else min(triton.next_power_of_2(tokens), 8)
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(n, tiles["BLOCK_N"]))
    args = (x, w, out, x.stride(0), w.stride(0), tokens, n, k)
    if dot:  # a pipeline stage: x's tile and the weights' (gate and up) tiles
        weight_tiles = 2 if gate_up else 1
        stage = (block_t + weight_tiles * tiles["BLOCK_N"]) * tiles["BLOCK_K"] * x.element_size()
        tiles = dict(tiles)
        split = split_k(tiles.pop("SPLIT_K", 1), grid[0] * grid[1], k, tiles["BLOCK_K"], x.device)
        parts = counts = None  # the split's float32 sums and its counters
        if split > 1:
            width = 2 * n if gate_up else n
            parts = torch.empty(
                split * grid[0] * block_t * width, dtype=torch.float32, device=x.device
            )
            counts = COUNTERS.get(x.device, grid[0] * grid[1])
        dense_dot_kernel[(*grid, split)](
            *args, GATE_UP=gate_up, BLOCK_T=block_t, **tuning.fit_stages(tiles, stage, x.device),
            **pdl_args(x.device), SPLIT_K=split, part_ptr=parts, count_ptr=counts,
        )  # fmt: skip
    else:
        dense_gemv_kernel[grid](
            *args, GATE_UP=gate_up, BLOCK_T=block_t, **tiles, **pdl_args(x.device),
            ROWS=min(tokens, block_t),
        )  # fmt: skip
    return out


MAX_SPLIT_K = 16


def split_k(asked: int, programs: int, k: int, block_k: int, device: torch.device) -> int:
    """The tensor-core product's programs per output tile, from its tiles' SPLIT_K (`asked`):
    1 none (a tiling without SPLIT_K), n that many, 0 the fewest, doubling, that give every SM
    a program (one wave of `programs` times the split; a CPU reads as one SM). Each split takes
    at least one tile of K, and there are at most MAX_SPLIT_K."""
    most = min(triton.cdiv(k, block_k), MAX_SPLIT_K)
    if asked:
        return max(1, min(asked, most))
    split, sms = 1, tuning.describe(device).sms
    while programs * split < sms and 2 * split <= most:
        split *= 2
    return split


COUNTERS = SplitCounters()  # the split product's, one buffer per device for the process


def device_choice(x: torch.Tensor, kind: str) -> tuple[dict, bool]:
    """(tiles, dot) for x's rows on x's device, a projection kind's (linear, gate_up or down):
    the row loop up to its gemv rows, past them the tensor-core product."""
    entry = tuning.for_device(x.device).gemv(kind)
    if x.shape[0] <= entry["rows"]:
        return entry["loop"], False
    return entry["dot"], True


def dense_gate_up(
    x: torch.Tensor, gate_up: torch.Tensor, tiles: dict | None = None, dot: bool = False
) -> torch.Tensor:
    """silu(gate @ x) * (up @ x) for a few rows in one launch: x (T, hidden), gate_up
    (2 * inter, hidden) = [gate | up] rows -> (T, inter). tiles: the row loop's (`dot`: the
    tensor-core product's); None: the device's choice for x's rows (device_choice)."""
    assert gate_up.is_contiguous()
    tiles, dot = (tiles, dot) if tiles else device_choice(x, "gate_up")
    return _dense(x, gate_up, gate_up.shape[0] // 2, True, tiles, dot)


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    tiles: dict | None = None,
    dot: bool = False,
    kind: str = "linear",
) -> torch.Tensor:
    """x @ w^T for a few rows, rounded once as F.linear: x (T, K) contiguous, w (N, K) with a
    contiguous last dim -> (T, N). tiles (BLOCK_N, BLOCK_K, num_warps): the row loop's (`dot`:
    the tensor-core product's, with num_stages); None: the device's choice for x's rows and
    the projection `kind` (device_choice)."""
    tiles, dot = (tiles, dot) if tiles else device_choice(x, kind)
    return _dense(x, w, w.shape[0], False, tiles, dot)
