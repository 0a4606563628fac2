"""The fp8 KV cache of the final engine (kv_cache_dtype="fp8"): the option, the block count it
buys, the Triton kernels against the PyTorch reference on an fp8 cache (widening its tiles, and
multiplying e4m3 on tensor cores: against a reference that quantizes q and P the same way, and
within a bound of the exact one), the reference against full-precision attention, and the
engine's greedy tokens against kv_cache_dtype="auto".

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before triton
is imported), so the shapes are tiny; with CUDA the same tests run the compiled kernels."""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of a kernel module

import argparse  # noqa: E402
import importlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from common import total  # noqa: E402

from nanovllm_final import LLM, SamplingParams  # noqa: E402
from nanovllm_final.config import EngineConfig, kv_cache_torch_dtype  # noqa: E402
from nanovllm_final.engine_flags import add_engine_options, engine_options  # noqa: E402
from nanovllm_final.layers import attention_torch as ref  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def tri():
    mod = importlib.import_module("nanovllm_final.kernels.attention")
    if not HAS_CUDA and type(mod._store_kvcache_kernel).__name__ != "InterpretedFunction":
        mod = importlib.reload(
            mod
        )  # imported before TRITON_INTERPRET was set: re-import it interpreted
    return mod


# ---- the option ----


def test_option_takes_vllm_names_and_refuses_others():
    assert EngineConfig(model="m").kv_cache_dtype == "auto"
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert (
            EngineConfig.from_options("m", device="cpu", kv_cache_dtype=name).kv_cache_dtype == name
        )
    for bad in ("int8", "fp8_e5m2", "", 8, None):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig.from_options("m", device="cpu", kv_cache_dtype=bad)
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert (
        kv_cache_torch_dtype("fp8", torch.bfloat16)
        == kv_cache_torch_dtype("fp8_e4m3", torch.float32)
        == FP8
    )


def test_flag_from_the_option():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert "--kv-cache-dtype" in parser.format_help()
    assert engine_options(parser.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"


def test_flash_attn_refuses_an_fp8_cache():
    from nanovllm_final.layers.attention import make_backend

    with pytest.raises(ValueError, match="fp8"):
        make_backend("flash_attn", torch.device("cpu"), 256, torch.bfloat16, FP8)
    assert make_backend("auto", torch.device("cpu"), 256, torch.bfloat16, FP8).name == "torch"


# ---- blocks ----


def test_fp8_doubles_the_blocks_of_bfloat16(model_dir):
    """The same cpu_kvcache_bytes holds twice the blocks of bfloat16 (four times float32's); the
    scales live outside the pool."""
    path, counts = model_dir("qwen3"), {}
    budget = (
        40 * 2 * 2 * 4 * 2 * 16 * 2
    )  # 40 bfloat16 blocks of the tiny model (2 layers, 4 slots, 2 kv heads of 16)
    for dtype, kv in (
        ("float32", "auto"),
        ("bfloat16", "auto"),
        ("bfloat16", "fp8"),
        ("float32", "fp8"),
    ):
        with LLM(
            path,
            device="cpu",
            dtype=dtype,
            kv_cache_dtype=kv,
            kvcache_block_size=4,
            max_model_len=32,
            cpu_kvcache_bytes=budget,
        ) as llm:
            runner = llm.engine.model_runner
            counts[dtype, kv] = runner.num_kvcache_blocks
            assert runner.kv_cache.dtype == (FP8 if kv == "fp8" else getattr(torch, dtype))
            assert runner.kv_cache.numel() * runner.kv_cache.element_size() <= budget
            layer = runner.attention_layers[0]
            assert (layer.k_scale is None) == (kv == "auto")
            if kv == "fp8":
                assert (
                    layer.k_scale.shape == (runner.num_kv_heads,)
                    and layer.k_scale.dtype == torch.float32
                )
    assert counts["bfloat16", "auto"] == 40
    assert (
        counts["bfloat16", "fp8"]
        == counts["float32", "fp8"]
        == 2 * counts["bfloat16", "auto"]
        == 4 * counts["float32", "auto"]
    )


# ---- kernels against the reference ----

SEQS = [
    (10, 10),
    (13, 4),
    (6, 1),
    (9, 1),
]  # (context_len, q_len): prefill, prefill after a prefix, decode
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
K_SCALE, V_SCALE = (
    (0.5, 0.03),
    (1.0, 0.004),
)  # per kv head: heads of different magnitudes, some values clamped


def fp8_case(store, seed: int = 0, outliers: bool = True) -> dict:
    """A batch on a shuffled paged fp8 cache, written by `store` (a backend's store_kvcache).
    K/V of kv head 1 are small, so that its scale matters; `outliers`: a key past +-448 * scale
    (clamped) and one stored as an e4m3 subnormal."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(c for c, _ in SEQS)
    magnitude = torch.tensor([1.0, 0.05])[:, None]  # (kv_heads, 1)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g) * magnitude
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=g) * magnitude
    if outliers:
        k[0, 0, :3] = torch.tensor([300.0, -500.0, 3e-3])  # clamped at +-448 * 0.5, and a subnormal
    k_scale, v_scale = (torch.tensor(s, device=DEVICE) for s in (K_SCALE, V_SCALE))
    blocks = [(c + BLOCK - 1) // BLOCK for c, _ in SEQS]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    block_tables = torch.full((len(SEQS), max(blocks) + 1), -1, dtype=torch.int32)
    slots = []
    for i, (ctx, _) in enumerate(SEQS):
        ids = [order.pop() for _ in range(blocks[i])]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)]
    k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    store(
        k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale
    )
    q = torch.randn(sum(n for _, n in SEQS), HEADS, HEAD_DIM, generator=g)
    cu = torch.tensor(
        [0] + [sum(n for _, n in SEQS[: i + 1]) for i in range(len(SEQS))], dtype=torch.int32
    )
    return dict(
        k=k,
        v=v,
        q=q.to(DEVICE),
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping,
        k_scale=k_scale,
        v_scale=v_scale,
        cu_seqlens_q=cu.to(DEVICE),
        context_lens=torch.tensor([c for c, _ in SEQS], dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
    )


def test_store_kernel_quantizes_like_the_reference(tri):
    got, want = fp8_case(tri.store_kvcache), fp8_case(ref.store_kvcache)
    for name in ("k_cache", "v_cache"):
        g, w = got[name].view(torch.uint8), want[name].view(torch.uint8)
        if (
            HAS_CUDA
        ):  # the GPU's fp32 division may round differently: a rare tie may land one e4m3 step away
            assert (g != w).float().mean() <= 1e-3
            torch.testing.assert_close(
                got[name].float(), want[name].float(), rtol=0.125, atol=2**-9
            )
        else:
            assert torch.equal(g, w), (
                name
            )  # the same bytes: round to nearest even, saturated at +-448
    stored = want["k_cache"].float().abs()
    assert stored.max() == 448  # the clamp was hit
    assert 0 < stored[stored > 0].min() < 2**-6  # and a subnormal kept


def _attention(backend, case, decode: bool, scale: float = 0.3, **kwargs):
    scales = dict(k_scale=case["k_scale"], v_scale=case["v_scale"])
    if decode:
        last = case["cu_seqlens_q"][1:].long() - 1  # each sequence's last query: its decode step
        return backend.paged_decode_attention(
            case["q"][last],
            case["k_cache"],
            case["v_cache"],
            case["context_lens"],
            case["block_tables"],
            scale,
            **scales,
            **kwargs,
        )
    max_q = int((case["cu_seqlens_q"][1:] - case["cu_seqlens_q"][:-1]).max())
    return backend.paged_prefill_attention(
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["cu_seqlens_q"],
        case["context_lens"],
        case["block_tables"],
        scale,
        max_q,
        **scales,
        **kwargs,
    )


@pytest.mark.parametrize(
    "decode,kwargs",
    [
        (False, dict(BLOCK_M=16, BLOCK_N=16)),
        (True, dict(num_splits=1, BLOCK_N=16)),
        (True, dict(num_splits=2, BLOCK_N=16)),
    ],
    ids=["prefill", "decode", "decode-split"],
)
def test_kernels_read_fp8_like_the_reference(tri, decode, kwargs):
    """Same fp8 cache, same scales: the kernels apply the scales in registers (K's in the
    softmax scale, V's on the output), the reference to its gathered K/V; in float32 only the
    summation order differs."""
    case = fp8_case(ref.store_kvcache)
    got, want = (
        _attention(tri, case, decode, fp8_dot=False, **kwargs),
        _attention(ref, case, decode),
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_kernels_under_bfloat16_match_the_reference_on_fp8(tri, decode):
    """Under bf16 the kernels widen an fp8 cache's tiles to fp16 (and q with them: _widen_to),
    not to bf16: still close to the reference, which dequantizes to bf16 and computes in float32.
    (Under the interpreter, bf16 tiles would not even be: it computes bf16 dots wrongly.)"""
    case = fp8_case(ref.store_kvcache, outliers=False)
    case["q"] = case["q"].to(torch.bfloat16)
    kwargs = dict(num_splits=2, BLOCK_N=16) if decode else dict(BLOCK_M=16, BLOCK_N=16)
    got, want = (
        _attention(tri, case, decode, fp8_dot=False, **kwargs),
        _attention(ref, case, decode),
    )
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "fp8_dot",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                HAS_CUDA and torch.cuda.get_device_capability() < (8, 9),
                reason="fp8 tl.dot needs compute capability 8.9+",
            ),
        ),
    ],
    ids=["widen", "fp8-dot"],
)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_kernel_stores_its_new_tokens_like_store_kvcache(tri, num_splits, fp8_dot):
    """The decode kernel writing each sequence's new (last) K/V itself quantizes them into the
    same bytes as the store kernel, and attends to them: as the reference does (widening), or
    as the same kernel does when the cache already holds them (fp8 products)."""
    case = fp8_case(tri.store_kvcache, outliers=False)
    k_full, v_full = case["k_cache"].clone(), case["v_cache"].clone()
    ends = torch.tensor(
        [sum(c for c, _ in SEQS[: i + 1]) - 1 for i in range(len(SEQS))]
    )  # each sequence's last token
    slots = case["slot_mapping"][ends.to(DEVICE)]
    case["k_cache"].view(-1, KV_HEADS, HEAD_DIM)[slots] = 0  # not stored yet
    case["v_cache"].view(-1, KV_HEADS, HEAD_DIM)[slots] = 0
    new_kv = (case["k"][ends].to(DEVICE), case["v"][ends].to(DEVICE), slots)
    kwargs = dict(num_splits=num_splits, BLOCK_N=32 if fp8_dot else 16, fp8_dot=fp8_dot)
    got = _attention(tri, case, True, new_kv=new_kv, **kwargs)
    assert torch.equal(case["k_cache"].view(torch.uint8), k_full.view(torch.uint8))
    assert torch.equal(case["v_cache"].view(torch.uint8), v_full.view(torch.uint8))
    want = _attention(tri, case, True, **kwargs) if fp8_dot else _attention(ref, case, True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_reference_is_attention_on_rounded_values_and_close_to_full_precision():
    """fp8 attention equals full-precision attention on the e4m3-rounded K/V (x / scale rounded,
    times scale), and stays within a bound of attention on the exact K/V. The bound: e4m3 keeps
    3 mantissa bits, so a stored value is off by at most half a step, 2**-4 of itself (2**-10
    * scale below 2**-6 * scale, the subnormals). An output row is a convex combination of V
    rows, so V's rounding moves it by at most max|dv|; K's rounding moves each score by at most
    d = 0.3 * sum_d |q_d| |dk_d|, which changes the softmax weights by at most exp(2d) - 1 in
    L1 norm, times max|v|. The error is not zero: the cache really is 8-bit."""
    case = fp8_case(ref.store_kvcache, outliers=False)
    out = _attention(ref, case, decode=False).cpu()  # (tokens, heads, head_dim)
    exact = {"k": case["k"], "v": case["v"]}  # (context tokens, kv_heads, head_dim)
    scales = {
        "k": torch.tensor(K_SCALE)[:, None],
        "v": torch.tensor(V_SCALE)[:, None],
    }  # (kv_heads, 1)
    rounded = {
        n: (x / scales[n]).clamp(-448, 448).to(FP8).float() * scales[n] for n, x in exact.items()
    }
    step = {
        n: 2**-4 * x.abs() + 2**-10 * scales[n] for n, x in exact.items()
    }  # half an e4m3 step, per value
    assert all(((rounded[n] - exact[n]).abs() <= step[n]).all() for n in exact)
    args = (case["cu_seqlens_q"].cpu(), case["context_lens"].cpu(), case["block_tables"].cpu())

    def full_precision(kv: dict) -> torch.Tensor:
        k_cache = torch.zeros(case["k_cache"].shape, dtype=torch.float32)
        v_cache = torch.zeros_like(k_cache)
        ref.store_kvcache(kv["k"], kv["v"], k_cache, v_cache, case["slot_mapping"].cpu())
        return ref.paged_attention(case["q"].cpu(), k_cache, v_cache, *args, 0.3)

    torch.testing.assert_close(out, full_precision(rounded), atol=1e-6, rtol=1e-6)
    error = (out - full_precision(exact)).abs().amax(dim=-1)  # (tokens, heads)
    q = case["q"].cpu().abs()  # (tokens, heads, head_dim)
    dk = step["k"].repeat_interleave(HEADS // KV_HEADS, dim=1)  # (context tokens, heads, head_dim)
    d = 0.3 * torch.einsum("qhd,khd->qhk", q, dk).amax(
        dim=-1
    )  # (tokens, heads), over every key: an upper bound
    bound = step["v"].amax() + exact["v"].abs().amax() * (torch.exp(2 * d) - 1)
    assert (error <= bound).all(), (error / bound).max()
    assert error.max() > 0


# ---- fp8 tensor-core products: e4m3 q (and P) by the cache's e4m3 K (and V) ----

CAN_FP8_DOT = not HAS_CUDA or torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_dot = pytest.mark.skipif(
    not CAN_FP8_DOT, reason="fp8 tl.dot needs compute capability 8.9+"
)
VARIANTS = [(pv, qs) for pv in (True, False) for qs in ("head", "tensor")]
VARIANT_IDS = [f"{'p-fp8' if pv else 'v-fp16'}-q-per-{qs}" for pv, qs in VARIANTS]


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to float8 e4m3 (nearest, ties to even; saturated at +-448), in float32."""
    return x.float().clamp(-448, 448).to(FP8).float()


def fp8_dot_reference(
    case, decode: bool, pv_fp8: bool, q_scale, scale: float
) -> tuple[torch.Tensor, ...]:
    """(out, bound, exact_bound): attention computed as the fp8-dot kernels compute it, in float32
    on the CPU: q rounded to e4m3 at its scale (each head's amax / 448, or q_scale), scores from
    it and the dequantized K, P rounded to e4m3 at 448 (pv_fp8) with the row's max subtracted over
    all of its keys. `bound`: on the kernels' distance from it when their tiles see the keys a tile
    at a time: P is then rounded at a running max, each value off by at most two half steps of
    e4m3 (2**-4 of itself) or of fp16 (2**-11), so |out - ref| <= 2 * step * sum(p |v|) / l.
    `exact_bound` (rows, heads): on their distance from the exact reference (q as it is, P exact),
    as in the test of the reference above: q's rounding moves a row's scores by at most d (here
    measured: the largest |dq . k| * scale over its keys), its weights by exp(2d) - 1 in L1 norm,
    times max|v|; P's rounding adds at most half a step of max|v|."""
    q, cu = case["q"].float().cpu(), case["cu_seqlens_q"].tolist()
    if decode:
        q, cu = q[[c - 1 for c in cu[1:]]], list(range(len(cu)))  # each sequence's last query
    out, bound, exact_bound = torch.zeros_like(q), torch.zeros_like(q), torch.zeros(q.shape[:2])
    group, step = q.shape[1] // case["k_cache"].shape[2], 2**-4 if pv_fp8 else 2**-11
    for i, ctx in enumerate(case["context_lens"].tolist()):
        qi = q[cu[i] : cu[i + 1]]  # (q_len, H, D)
        q_s = (
            qi.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448
            if q_scale is None
            else q_scale.cpu()
        )
        q8 = e4m3(qi / q_s) * q_s
        k, v = (
            ref.dequantize(
                ref.gather_kv(case[n].cpu(), case["block_tables"][i].cpu(), ctx),
                case[s].cpu(),
                torch.float32,
            ).repeat_interleave(group, dim=1)
            for n, s in (("k_cache", "k_scale"), ("v_cache", "v_scale"))
        )
        causal = (
            torch.arange(ctx)[None, :] <= torch.arange(ctx - len(qi), ctx)[:, None]
        )  # (q_len, ctx)
        s = (torch.einsum("qhd,khd->hqk", q8, k) * scale).masked_fill(
            ~causal, float("-inf")
        )  # (H, q_len, ctx)
        p = torch.exp(s - s.amax(-1, keepdim=True))
        l = p.sum(-1, keepdim=True)
        out[cu[i] : cu[i + 1]] = torch.einsum(
            "hqk,khd->qhd", (e4m3(p * 448) / 448 if pv_fp8 else p) / l, v
        )
        bound[cu[i] : cu[i + 1]] = 2 * step * torch.einsum("hqk,khd->qhd", p / l, v.abs()) + 1e-5
        d = (
            (torch.einsum("qhd,khd->hqk", q8 - qi, k).abs() * scale * causal).amax(-1).T
        )  # (q_len, H)
        exact_bound[cu[i] : cu[i + 1]] = v.abs().amax() * (torch.exp(2 * d) - 1 + step) + 1e-5
    return out, bound, exact_bound


def _fp8_dot(tri, case, decode: bool, pv_fp8: bool, q_scale: str, scale: float = 0.3, **kwargs):
    """The kernels' fp8-dot attention and q's static scale (None: per head)."""
    q_s = None if q_scale == "head" else torch.tensor([0.02], device=DEVICE)
    out = _attention(
        tri, case, decode, fp8_dot=True, pv_fp8=pv_fp8, q_scale=q_s, scale=scale, **kwargs
    )
    return out.float().cpu(), q_s


@needs_fp8_dot
@pytest.mark.parametrize("pv_fp8,q_scale", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize(
    "decode,rows",
    [(False, None), (True, None), (True, 64)],
    ids=["prefill", "decode", "decode-64-rows"],
)
def test_fp8_dot_kernels_quantize_like_the_reference(tri, decode, rows, pv_fp8, q_scale):
    """Every context of this batch fits one key tile, so the kernels round P at the row's true
    max, as the reference does: the same roundings, only the summation order differs (and P's
    fp16 rounding, with V widened). Also within the bound of the exact reference. Decode also with
    its query heads padded to the 64 rows of Hopper's warpgroup products (_group_rows)."""
    case = fp8_case(ref.store_kvcache, outliers=False)
    # e4m3 products take K >= 32
    kwargs = (
        dict(num_splits=1, BLOCK_N=32, BLOCK_H=rows) if decode else dict(BLOCK_M=16, BLOCK_N=32)
    )
    got, q_s = _fp8_dot(tri, case, decode, pv_fp8, q_scale, **kwargs)
    want, bound, exact_bound = fp8_dot_reference(case, decode, pv_fp8, q_s, 0.3)
    close = (got - want).abs() <= (1e-5 if pv_fp8 else 1e-3) + (
        1e-4 if pv_fp8 else 2e-3
    ) * want.abs()
    # A GPU's exp2 (and its fp8 products' accumulation) may round a score a few ulps apart, moving
    # the rare P that lies that close to a rounding boundary one e4m3 step: still within `bound`.
    assert (
        close.all()
        if not HAS_CUDA
        else close.float().mean() >= 0.98 and ((got - want).abs() <= bound).all()
    )
    error = (got - _attention(ref, case, decode).float().cpu()).abs().amax(-1)  # (rows, heads)
    assert (error <= exact_bound).all() and error.max() > 0


def workload_case(decode: bool, seed: int = 0) -> dict:
    """Contexts of nano-vllm's workload (prompts of 100-1024 tokens, up to 1024 generated) at
    head_dim 128 and the engine's scales of 1.0: decode steps at contexts 100, 1000 and 2047, or
    prefill chunks of 16 and 40 queries after cached prefixes of 1000 and 500 tokens."""
    seqs = [(100, 1), (1000, 1), (2047, 1)] if decode else [(1016, 16), (540, 40)]
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim, block = 4, 2, 128, 16
    blocks = [(c + block - 1) // block for c, _ in seqs]
    perm = torch.randperm(sum(blocks), generator=g)
    tables = torch.full((len(seqs), max(blocks)), -1, dtype=torch.int32)
    for i, start in enumerate(torch.tensor([0, *blocks]).cumsum(0)[:-1].tolist()):
        tables[i, : blocks[i]] = perm[start : start + blocks[i]].to(torch.int32)
    k_cache, v_cache = (
        e4m3(torch.randn(sum(blocks), block, kv_heads, head_dim, generator=g) * 2).to(FP8)
        for _ in "kv"
    )
    q = torch.randn(sum(n for _, n in seqs), heads, head_dim, generator=g) * 2
    cu = torch.tensor([0, *[n for _, n in seqs]]).cumsum(0).to(torch.int32)
    ones = torch.ones(kv_heads)
    return {
        n: x.to(DEVICE)
        for n, x in dict(
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            k_scale=ones,
            v_scale=ones,
            cu_seqlens_q=cu,
            block_tables=tables,
            context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        ).items()
    }


@needs_fp8_dot
@pytest.mark.parametrize("pv_fp8,q_scale", VARIANTS[:3], ids=VARIANT_IDS[:3])
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_fp8_dot_kernels_at_the_workloads_contexts(tri, decode, pv_fp8, q_scale):
    """Contexts of up to 2047 keys, many tiles each (and split-K for decode): within the bound of
    the reference that rounds as the kernels do (P at a running max, see fp8_dot_reference) and
    of the exact one."""
    case, scale = workload_case(decode), 128**-0.5
    kwargs = dict(num_splits=2, BLOCK_N=64) if decode else dict(BLOCK_M=16, BLOCK_N=64)
    got, q_s = _fp8_dot(tri, case, decode, pv_fp8, q_scale, scale=scale, **kwargs)
    want, bound, exact_bound = fp8_dot_reference(case, decode, pv_fp8, q_s, scale)
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()
    error = (
        (got - _attention(ref, case, decode, scale=scale).float().cpu()).abs().amax(-1)
    )  # (rows, heads)
    assert (error <= exact_bound).all(), (error / exact_bound).max()


def test_fp8_dot_only_where_the_device_multiplies_e4m3(monkeypatch):
    """The dispatch takes fp8 products for fp16/bf16 q on CUDA devices of compute capability 8.9+
    where NANOVLLM_FP8_DOT=1 asks for them (widening is the default); never on a CPU or for
    float32 q."""
    from nanovllm_final.kernels import dispatch

    assert not dispatch.fp8_dot(torch.zeros(1, dtype=torch.bfloat16)) and not dispatch.fp8_dot(
        torch.zeros(1)
    )
    check = dispatch._fp8_dot_device.__wrapped__
    for capability, env, want in (
        ((9, 0), "1", True),
        ((8, 9), "1", True),
        ((9, 0), None, False),
        ((8, 6), "1", False),
        ((9, 0), "0", False),
    ):
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda device=None, c=capability: c
        )
        if env is None:
            monkeypatch.delenv("NANOVLLM_FP8_DOT", raising=False)
        else:
            monkeypatch.setenv("NANOVLLM_FP8_DOT", env)
        assert check(torch.device("cuda", 0)) == want, (capability, env)


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the script times every variant (minutes)")
def test_fp8_attention_bench_checks_correctness_on_a_cpu_then_exits_2():
    """benchmarks/fp8_attention_bench.py without CUDA: its correctness part in the interpreter,
    every variant within its bound, then a clear exit 2 (the timings need a GPU)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "benchmarks/fp8_attention_bench.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "timings need a CUDA GPU" in done.stderr
    for variant in ("widen", "p-fp8 q-head", "p-fp8 q-tensor", "v-fp16 q-head", "v-fp16 q-tensor"):
        assert done.stdout.count(f"{variant} 0.0") == 2, (
            done.stdout
        )  # decode and prefill, relative errors < 0.1
    assert "FAIL" not in done.stdout and "ERROR" not in done.stdout


def test_decode_rows_are_a_warpgroups_for_e4m3_products_on_hopper(tri, monkeypatch):
    """The decode kernel's products take the GQA group padded to 16 rows, or to 64 for e4m3
    products on Hopper with a multiple of 4 warps (warpgroup MMA, the only one there for e4m3)."""
    from nanovllm_final.kernels import tuning

    cuda = torch.device("cuda", 0)
    for capability, dot, warps, want in (
        ((9, 0), True, 4, 64),
        ((9, 0), True, 8, 64),
        ((9, 0), True, 2, 16),
        ((8, 9), True, 4, 16),
        ((9, 0), False, 4, 16),
    ):
        monkeypatch.setattr(
            tuning,
            "describe",
            lambda device, c=capability: tuning.Device("gpu", 132, 1 << 17, c, 0),
        )
        assert tri._group_rows(2, {"FP8_DOT": dot}, warps, cuda) == want, (capability, dot, warps)
    assert (
        tri._group_rows(32, {"FP8_DOT": True}, 4, cuda) == 64
        and tri._group_rows(128, {"FP8_DOT": False}, 4, cuda) == 128
    )


# ---- the engine ----


COURSE_MODEL = Path(__file__).resolve().parents[1] / "models" / "course-llama"
STORY_PROMPTS = [
    "a kind boy named",
    "a little cat who",
    "an old fisherman. One day,",
    "a girl named Mia. She loved",
    "a brave fox named Rusty.",
    "two friends who",
]


def test_engine_fp8_greedy_agrees_with_auto():
    """Prefix cache, chunked prefill and preemption in one run, on the default backend (the
    PyTorch reference on CPU, the Triton kernels with CUDA graphs on a GPU): the course model's
    greedy stories with an fp8 cache against the model's dtype, position by position until the
    first difference. Float32 on both devices, so that only fp8's rounding differs: in bfloat16
    the near-ties of some greedy choices flip under bf16's own rounding as well (on an H200 the
    bf16 engine agreed on 70% of these positions). (A random-weight model is a poor judge here:
    its top two logprobs are often within 0.1, so any rounding flips its argmax.)"""
    prefix = "Once upon a time, in a small village by the sea, there lived "
    options = dict(
        device=DEVICE,
        dtype="float32",
        max_model_len=64,
        kvcache_block_size=4,
        num_kvcache_blocks=24,
        max_num_batched_tokens=16,
        max_num_seqs=6,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for kv in ("auto", "fp8"):
        with LLM(str(COURSE_MODEL), kv_cache_dtype=kv, **options) as llm:
            tokens[kv] = [
                o["token_ids"]
                for o in llm.generate([prefix + p for p in STORY_PROMPTS], params, use_tqdm=False)
            ]
            assert (
                total(llm, "preemptions") > 0
                and total(llm, "chunked_prefills") > 0
                and total(llm, "prefix_hit_blocks") > 0
            )
    agree = [
        next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        for x, y in zip(tokens["auto"], tokens["fp8"])
    ]
    share = sum(agree) / sum(map(len, tokens["auto"]))
    assert share >= 0.9, (
        f"fp8 agrees with auto on {share:.0%} of the positions before the first difference: {agree}"
    )


@pytest.mark.skipif(
    not HAS_CUDA or not CAN_FP8_DOT, reason="needs a CUDA GPU of compute capability 8.9+"
)
def test_engine_fp8_dot_agrees_with_widening(monkeypatch):
    """The bf16 engine on an fp8 cache, CUDA graphs and the fused decode launch (K stored, RoPE
    applied): with fp8 tensor-core products, as the device's default, against the same engine
    widening its tiles. Both round K/V to e4m3; the products also round q and P, which moves
    near-ties, so the bar is the share of greedy positions before the first difference."""
    from nanovllm_final.kernels import dispatch

    options = dict(
        device="cuda",
        dtype="bfloat16",
        kv_cache_dtype="fp8",
        max_model_len=96,
        kvcache_block_size=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = ["Once upon a time, there lived " + p for p in STORY_PROMPTS]
    tokens = {}
    for dot in (True, False):
        monkeypatch.setattr(dispatch, "fp8_dot", lambda q, dot=dot: dot)
        with LLM(str(COURSE_MODEL), **options) as llm:
            tokens[dot] = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    agree = [
        next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        for x, y in zip(tokens[True], tokens[False])
    ]
    assert sum(agree) / sum(map(len, tokens[False])) >= 0.5, agree
