"""The final engine's MoE and matrix-vector kernels (kernels/moe.py, kernels/gemv.py) against the
references in layers/moe.py: the router against route_torch, the experts against the loop over
the experts (Experts.forward_loop); the dense layers' few rows against F.linear and the MLP.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by
conftest.py before triton is imported), in float32 and float16: the interpreter computes
bfloat16 dots wrongly (numpy has no bfloat16), so bfloat16 is checked on a GPU only, as are
the CUDA-graph capture and the automatic choice of the fused path."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

fused_moe = pytest.importorskip("nanovllm_final.kernels.moe")
from nanovllm_final.kernels import gemv, tuning  # noqa: E402

ALIGN = fused_moe.align_by_expert
from nanovllm_final.layers.moe import Experts, route, route_torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# tokens, experts, top_k, hidden, expert width
SHAPES = [(1, 8, 2, 64, 32), (5, 8, 2, 64, 32), (37, 6, 3, 40, 24), (3, 16, 8, 40, 24)]


def tol(dtype: torch.dtype) -> dict:
    # half types: the kernels sum in float32 where the loop adds rounded per-expert outputs
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}


def make_case(
    tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    width: int,
    dtype: torch.dtype,
    seed: int = 0,
):
    g = torch.Generator().manual_seed(seed)
    experts = Experts(num_experts, hidden, width)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.2)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, num_experts, generator=g), top_k, renormalize=True)
    return experts.to(dtype), x.to(dtype), weights.to(dtype), ids


def fused(experts: Experts, x, weights, ids, **kwargs) -> torch.Tensor:
    args = [
        t.to(DEVICE) for t in (x, experts.gate_up_proj.data, experts.down_proj.data, weights, ids)
    ]
    return fused_moe.fused_experts(*args, **kwargs).cpu()


def distinct_logits(
    tokens: int, num_experts: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """(tokens, experts) logits, each row a shuffle of distinct multiples of 1/16 (exact in half
    types): no two experts tie, so the order of the top_k is the same for any correct router."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=g) for _ in range(tokens)]
    steps = torch.stack(rows) if rows else torch.empty(0, num_experts)  # (tokens, experts)
    return ((steps - num_experts // 2) / 16).to(dtype)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "tokens, num_experts, top_k", [(3, 128, 8), (1, 8, 2), (5, 60, 3), (2, 512, 16), (0, 16, 2)]
)
def test_fused_route_matches_route(tokens, num_experts, top_k, dtype, renormalize):
    """The same experts in the same order, the weights in the logits' dtype to rounding."""
    logits = distinct_logits(tokens, num_experts, dtype, seed=tokens).to(DEVICE)
    weights, ids = fused_moe.fused_route(logits, top_k, renormalize)
    ref_weights, ref_ids = route_torch(logits, top_k, renormalize)
    assert (
        weights.dtype == dtype
        and ids.dtype == torch.int64
        and weights.shape == ids.shape == (tokens, top_k)
    )
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(
        weights, ref_weights, **({"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {})
    )


def test_fused_route_ties_take_the_lowest_expert():
    """Equal probabilities: the lower expert index first (torch.topk leaves that order open)."""
    logits = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0, 0.0, 1.0, 1.0],
            [0.0] * 8,
            [-1.0, 5.0, -1.0, 5.0, -1.0, -1.0, 0.0, 0.0],
        ]
    )
    weights, ids = fused_moe.fused_route(logits.to(DEVICE), 4, renormalize=True)
    assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3], [1, 3, 6, 7]]
    probs = torch.softmax(logits, dim=-1).gather(
        1, torch.tensor([[1, 2, 4, 3], [0, 1, 2, 3], [1, 3, 6, 7]])
    )  # (3, 4)
    torch.testing.assert_close(weights.cpu(), probs / probs.sum(dim=-1, keepdim=True))


def test_route_dispatch(monkeypatch):
    """route: the kernel for CUDA logits, route_torch for CPU logits."""
    calls = []
    real = fused_moe.fused_route
    monkeypatch.setattr(fused_moe, "fused_route", lambda *args: calls.append(1) or real(*args))
    logits = distinct_logits(4, 16, torch.float32)
    assert (
        all(torch.equal(a, b) for a, b in zip(route(logits, 2, True), route_torch(logits, 2, True)))
        and calls == []
    )
    if HAS_CUDA:
        weights, ids = route(logits.cuda(), 2, True)
        assert (
            calls == [1] and ids.is_cuda and torch.equal(ids.cpu(), route_torch(logits, 2, True)[1])
        )


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize(
    "tokens, num_experts, top_k", [(1, 8, 2), (5, 8, 2), (37, 6, 3), (3, 128, 8)]
)
def test_align_by_expert(tokens, num_experts, top_k, block_m):
    """Every (token, slot) pair lands once, in a block of its own expert; each expert's run is
    padded to whole blocks; the buffer sizes depend on the shapes only."""
    ids = (
        torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(tokens))
        .topk(top_k, dim=-1)
        .indices
    )
    rows, block_expert, num_rows = fused_moe.align_by_expert(ids.to(DEVICE), num_experts, block_m)
    rows, block_expert, used = rows.cpu(), block_expert.cpu(), int(num_rows.item())
    pairs = tokens * top_k
    assert (
        rows.numel()
        == block_expert.numel() * block_m
        == -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    )
    assert used % block_m == 0 and used <= rows.numel()
    real = rows[rows < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # each pair once
    assert (rows[used:] == pairs).all()  # past the rows in use: padding only
    flat = ids.flatten()
    for b in range(used // block_m):
        block = rows[b * block_m : (b + 1) * block_m]
        block = block[block < pairs]
        assert len(block) > 0 and (flat[block.long()] == block_expert[b]).all()
    hit = flat.unique()
    assert used == sum(-(-int((flat == e).sum()) // block_m) * block_m for e in hit)


@pytest.mark.parametrize("small", [False, True], ids=["grouped", "gemv"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_matches_loop(shape, dtype, small):
    """Both paths: the grouped GEMMs and the matrix-vector products of few tokens."""
    experts, x, weights, ids = make_case(*shape, dtype=dtype)
    expected = experts.forward_loop(x, weights, ids)  # on CPU, in the same dtype
    tiles = (
        {"DOWN_BLOCK_N": 8} if small and not HAS_CUDA else None
    )  # fewer programs for the interpreter
    out = fused(experts, x, weights, ids, small=small, tiles=tiles)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **tol(dtype))


@pytest.mark.parametrize("down_block_n, block_k", [(1, 16), (16, 256)])
def test_gemv_tiles(down_block_n, block_k):
    """The matrix-vector path's tiles: several K steps with a ragged last one, and down blocks of
    one column or wider than the hidden size's last block (40 = 2 * 16 + 8)."""
    experts, x, weights, ids = make_case(3, 16, 8, 40, 24, torch.float16, seed=2)
    out = fused(
        experts,
        x,
        weights,
        ids,
        small=True,
        tiles={"BLOCK_K": block_k, "DOWN_BLOCK_N": down_block_n, "DOWN_BLOCK_K": block_k},
    )
    torch.testing.assert_close(out, experts.forward_loop(x, weights, ids), **tol(torch.float16))


@pytest.mark.parametrize("block_m", [16, 64])
def test_unrouted_experts_and_block_sizes(block_m):
    """Experts 1, 2 and 5 get no token; both block sizes give the loop's result."""
    experts, x, weights, _ = make_case(9, 6, 2, 48, 40, torch.float32, seed=3)
    ids = torch.tensor([[0, 3], [4, 0], [3, 4], [0, 4], [3, 0], [4, 3], [0, 3], [3, 4], [4, 0]])
    expected = experts.forward_loop(x, weights, ids)
    torch.testing.assert_close(
        fused(experts, x, weights, ids, block_m=block_m, small=False),
        expected,
        **tol(torch.float32),
    )
    torch.testing.assert_close(
        fused(experts, x, weights, ids, small=True), expected, **tol(torch.float32)
    )


def test_small_batches_take_the_gemv_path(monkeypatch):
    """Up to the device's moe.small_pairs (token, expert) pairs skip the grouping; one pair more is grouped."""
    calls = []
    monkeypatch.setattr(fused_moe, "align_by_expert", lambda *a: calls.append(a) or ALIGN(*a))
    top_k, small_pairs = 2, tuning.for_device(torch.device(DEVICE)).moe_small_pairs
    for tokens, grouped in ((small_pairs // top_k, False), (small_pairs // top_k + 1, True)):
        calls.clear()
        experts, x, weights, ids = make_case(tokens, 8, top_k, 32, 16, torch.float32)
        torch.testing.assert_close(
            fused(experts, x, weights, ids),
            experts.forward_loop(x, weights, ids),
            **tol(torch.float32),
        )
        assert bool(calls) == grouped


@pytest.mark.parametrize(
    "dot, split",
    [(False, None), (True, None), (True, 3)],
    ids=["row-loop", "tensor-core", "tensor-core-split-k"],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 5, 8, 17])
def test_dense_layers_on_the_matrix_vector_kernels(tokens, dtype, dot, split):
    """A dense layer's few rows on either few-row kernel (the row loop, the tensor-core product,
    also split three ways along K): `gemv` is F.linear, gate/up then down a SwiGLU MLP's gate/up,
    SiLU-and-multiply and down, with a K of several tiles and a ragged last one (72 = 2 * 32 + 8
    on a CPU's tiles), an output width not a multiple of the columns, and rows filling part of a
    program (3, 5), all of one (8; 16 for the product) or spilling into a second (17). Each row
    equals, bit for bit, that row among other rows and that row alone: the rows beside it change
    nothing. (Under the interpreter the product is numpy's matmul, which on some CPUs rounds a row
    by its place in the 16-row tile, so there the tensor-core product's row is checked in its
    place only.)"""
    choice = tuning.for_device(torch.device(DEVICE))

    def tiles(kind: str) -> dict:
        chosen = choice.gemv(kind)["dot" if dot else "loop"]
        return chosen if split is None else {**chosen, "SPLIT_K": split}

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 72, generator=g).to(dtype)
    w = (torch.randn(45, 72, generator=g) * 0.2).to(dtype)
    out = gemv.gemv(x.to(DEVICE), w.to(DEVICE), tiles("linear"), dot).cpu()
    assert out.shape == (tokens, 45) and out.dtype == dtype
    torch.testing.assert_close(
        out, torch.nn.functional.linear(x.float(), w.float()).to(dtype), **tol(dtype)
    )
    gate_up, down = (
        (torch.randn(2 * 24, 72, generator=g) * 0.2).to(dtype).to(DEVICE),
        (torch.randn(72, 24, generator=g) * 0.2).to(dtype).to(DEVICE),
    )

    def mlp(rows: torch.Tensor) -> torch.Tensor:
        h = gemv.dense_gate_up(rows.to(DEVICE), gate_up, tiles("gate_up"), dot)
        return gemv.gemv(h, down, tiles("down"), dot).cpu()

    h = torch.nn.functional.linear(x, gate_up.cpu())  # (tokens, 2 * 24) = [gate | up]
    expected = torch.nn.functional.linear(
        torch.nn.functional.silu(h[:, :24]) * h[:, 24:], down.cpu()
    )
    out = mlp(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, expected, **tol(dtype))
    for row in {0, tokens // 2, tokens - 1}:
        beside = torch.randn(x.shape, generator=g).to(dtype)  # other rows, this one in its place
        beside[row] = x[row]
        assert torch.equal(mlp(beside)[row], out[row])
        if HAS_CUDA or not dot:
            assert torch.equal(mlp(x[row : row + 1])[0], out[row])


def test_few_rows_take_the_row_loop_then_the_tensor_core_product():
    """Each projection kind's choice by rows: its row loop up to its gemv rows, its tensor-core
    product up to its dot_rows (dispatch then sends no more rows to either), each kind on its
    own: gemv and dense_gate_up follow their kind's choice."""
    from nanovllm_final.kernels import dispatch

    device = torch.device(DEVICE)
    with tuning.override(
        {"gemv": {"down": {"rows": 2, "dot_rows": 6}, "gate_up": {"rows": 0, "dot_rows": 3}}}
    ):
        choice = tuning.for_device(device)
        down, gate_up = choice.gemv("down"), choice.gemv("gate_up")
        assert (choice.few_rows("down"), choice.few_rows("gate_up")) == (6, 3)
        rows = lambda n: torch.zeros(n, 8, device=device)  # noqa: E731
        assert gemv.device_choice(rows(2), "down") == (down["loop"], False)
        assert gemv.device_choice(rows(3), "down") == (down["dot"], True)
        assert gemv.device_choice(rows(1), "gate_up") == (gate_up["dot"], True)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 40, generator=g).to(DEVICE)
        w_gate_up = (torch.randn(48, 40, generator=g) * 0.2).to(DEVICE)
        w_down = (torch.randn(40, 24, generator=g) * 0.2).to(DEVICE)
        h = gemv.dense_gate_up(x[:2], w_gate_up)
        assert torch.equal(h, gemv.dense_gate_up(x[:2], w_gate_up, gate_up["dot"], True))
        assert torch.equal(gemv.gemv(h, w_down, kind="down"), gemv.gemv(h, w_down, down["loop"]))
        if HAS_CUDA:
            x = x.bfloat16().cuda()
            assert dispatch.takes_gemv(x[:3], "gate_up") and dispatch.takes_gemv(x[:5], "down")
            assert not dispatch.takes_gemv(x[:4], "gate_up")
            assert not dispatch.takes_gemv(
                torch.zeros(7, 40, dtype=torch.bfloat16, device="cuda"), "down"
            )
    with tuning.override({"gemv": {"down": {"rows": 4, "dot_rows": 0}}}):
        assert tuning.for_device(device).few_rows("down") == 4


@pytest.mark.skipif(not HAS_CUDA, reason="the layers use the kernels on CUDA only")
def test_dense_layers_dispatch_few_rows_to_the_kernels(monkeypatch):
    """On CUDA, Linear and the dense MLP's two projections each take their kind's few-row
    kernels up to its few_rows and cuBLAS beyond; every path gives the PyTorch result."""
    from types import SimpleNamespace

    from nanovllm_final.layers.linear import Linear
    from nanovllm_final.models.transformer import MLP

    calls = []
    for name in ("gemv", "dense_gate_up"):
        real = getattr(gemv, name)
        monkeypatch.setattr(
            gemv,
            name,
            lambda *a, real=real, name=name, **kw: (
                calls.append((name, kw.get("kind"))) or real(*a, **kw)
            ),
        )
    g = torch.Generator().manual_seed(0)
    linear = Linear(256, 96).to(torch.bfloat16).cuda()
    mlp = (
        MLP(SimpleNamespace(hidden_size=256, intermediate_size=384)).to(torch.bfloat16).cuda()
    )  # the fields MLP reads
    for p in (*linear.parameters(), *mlp.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    limits = {"linear": 2, "gate_up": 4, "down": 1}
    with tuning.override({"gemv": {k: {"rows": 1, "dot_rows": n} for k, n in limits.items()}}):
        for rows in (1, 2, 3, 5):
            calls.clear()
            x = torch.randn(rows, 256, generator=g).to(torch.bfloat16).cuda()
            torch.testing.assert_close(
                linear(x), torch.nn.functional.linear(x, linear.weight), **tol(torch.bfloat16)
            )
            gate, up = torch.nn.functional.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
            expected = torch.nn.functional.linear(
                torch.nn.functional.silu(gate) * up, mlp.down_proj.weight
            )
            torch.testing.assert_close(mlp(x), expected, **tol(torch.bfloat16))
            assert calls == [
                *[("gemv", "linear")] * (rows <= limits["linear"]),
                *[("dense_gate_up", None)] * (rows <= limits["gate_up"]),
                *[("gemv", "down")] * (rows <= limits["down"]),
            ]


def test_no_tokens():
    experts, x, weights, ids = make_case(0, 4, 2, 32, 16, torch.float32)
    assert fused(experts, x, weights, ids).shape == (0, 32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("small", [False, True], ids=["grouped", "gemv"])
def test_cuda_graph_replay_follows_new_routing(small):
    """Captured once, replayed with other tokens and other experts: the grid and buffers do not
    depend on the routing, so the replay equals an eager call."""
    experts, x, weights, ids = make_case(8, 16, 4, 256, 128, torch.bfloat16)
    experts = experts.cuda()
    static = [t.cuda() for t in (x, weights, ids)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_moe.fused_experts(
            static[0], experts.gate_up_proj, experts.down_proj, static[1], static[2], small=small
        )  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_experts(
            static[0], experts.gate_up_proj, experts.down_proj, static[1], static[2], small=small
        )
    _, x2, weights2, ids2 = make_case(8, 16, 4, 256, 128, torch.bfloat16, seed=1)
    for buffer, new in zip(static, (x2, weights2, ids2)):
        buffer.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = fused_moe.fused_experts(
        x2.cuda(),
        experts.gate_up_proj,
        experts.down_proj,
        weights2.cuda(),
        ids2.cuda(),
        small=small,
    )
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_selects_the_fused_path(monkeypatch):
    experts, x, weights, ids = make_case(5, 8, 2, 64, 32, torch.bfloat16)
    calls = []
    real = fused_moe.fused_experts
    monkeypatch.setattr(fused_moe, "fused_experts", lambda *args: calls.append(1) or real(*args))
    experts = experts.cuda()
    out = experts(x.cuda(), weights.cuda(), ids.cuda())
    assert calls == [1]
    torch.testing.assert_close(
        out.cpu(), experts.cpu().forward_loop(x, weights, ids), **tol(torch.bfloat16)
    )


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_graph_replay_of_the_router():
    """Captured once, replayed with other logits: equals an eager call, bit for bit."""
    static = distinct_logits(8, 128, torch.bfloat16).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_moe.fused_route(static, 8, True)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = fused_moe.fused_route(static, 8, True)
    static.copy_(distinct_logits(8, 128, torch.bfloat16, seed=1))
    graph.replay()
    torch.cuda.synchronize()
    eager_weights, eager_ids = fused_moe.fused_route(static.clone(), 8, True)
    assert torch.equal(ids, eager_ids) and torch.equal(weights, eager_weights)


def test_split_k_gives_every_sm_a_program(monkeypatch):
    """SPLIT_K 0: the tensor-core product splits K until its programs cover the SMs once,
    doubling, at most one split per tile of K and MAX_SPLIT_K; a split asked for is cut to the
    same bounds; 1 (a tiling without SPLIT_K) splits nothing."""
    gpu = tuning.Device("gpu", 132, 228 * 1024, (9, 0), 50 << 20)
    monkeypatch.setattr(tuning, "describe", lambda device: gpu)
    device = torch.device("cpu")
    assert gemv.split_k(0, 32, 2048, 512, device) == 4  # o_proj of 0.6B: 32 -> 128 programs
    assert gemv.split_k(0, 32, 3072, 512, device) == 4  # down: 6 tiles of K, 4 splits
    assert gemv.split_k(0, 128, 1024, 512, device) == 2  # qkv: 256 programs
    assert gemv.split_k(0, 192, 1024, 128, device) == 1  # already a wave
    assert gemv.split_k(0, 1, 1 << 20, 128, device) == gemv.MAX_SPLIT_K
    assert gemv.split_k(0, 32, 512, 512, device) == 1  # one tile of K: nothing to split
    assert gemv.split_k(1, 32, 2048, 512, device) == 1
    assert gemv.split_k(5, 1, 72, 32, device) == 3  # asked: at most K's 3 tiles


@pytest.mark.skipif(not HAS_CUDA, reason="the device's tilings split these shapes only on a GPU")
@pytest.mark.parametrize("rows", [5, 16])
def test_split_k_product_on_the_qwen3_0_6b_shapes(rows):
    """The split tensor-core product (SPLIT_K 0: split until the programs cover the SMs) on
    Qwen3-0.6B's projections, whose K spans several of the device's tiles: F.linear within
    bf16's rounding and the unsplit product within a rounding step, each row bit for bit that
    row alone, the same output launch after launch, and every split counter back at zero."""
    g = torch.Generator().manual_seed(rows)
    for kind, (n, k) in [
        ("linear", (4096, 1024)),
        ("linear", (1024, 2048)),
        ("down", (1024, 3072)),
    ]:
        tiles = {**tuning.for_device(torch.device(DEVICE)).gemv(kind)["dot"], "SPLIT_K": 0}
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).to(DEVICE)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16).to(DEVICE)
        assert gemv.split_k(0, -(-n // tiles["BLOCK_N"]), k, tiles["BLOCK_K"], x.device) > 1
        out = gemv.gemv(x, w, tiles, True)
        unsplit = gemv.gemv(x, w, {**tiles, "SPLIT_K": 1}, True)
        reference = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(out.float(), reference, **tol(torch.bfloat16))
        # the float32 sums differ in order only: at most a rounding step of bf16 apart
        torch.testing.assert_close(out, unsplit, atol=1e-2, rtol=1e-2)
        assert torch.equal(gemv.gemv(x[2:3], w, tiles, True)[0], out[2])
        assert torch.equal(gemv.gemv(x, w, tiles, True), out)
    assert all(int(c.abs().sum()) == 0 for b in gemv.COUNTERS.buffers.values() for c in b)
