"""The fp8 KV cache of the final engine (kv_cache_dtype="fp8"): the option, the block count it
buys, the Triton kernels against the PyTorch reference on an fp8 cache, the reference against
full-precision attention, and the engine's greedy tokens against kv_cache_dtype="auto".

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
        mod = importlib.reload(mod)  # imported before TRITON_INTERPRET was set: re-import it interpreted
    return mod


# ---- the option ----


def test_option_takes_vllm_names_and_refuses_others():
    assert EngineConfig(model="m").kv_cache_dtype == "auto"
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert EngineConfig.from_options("m", device="cpu", kv_cache_dtype=name).kv_cache_dtype == name
    for bad in ("int8", "fp8_e5m2", "", 8, None):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig.from_options("m", device="cpu", kv_cache_dtype=bad)
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8


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
    budget = 40 * 2 * 2 * 4 * 2 * 16 * 2  # 40 bfloat16 blocks of the tiny model (2 layers, 4 slots, 2 kv heads of 16)
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "fp8")):
        with LLM(path, device="cpu", dtype=dtype, kv_cache_dtype=kv, kvcache_block_size=4, max_model_len=32,
                 cpu_kvcache_bytes=budget) as llm:
            runner = llm.engine.model_runner
            counts[dtype, kv] = runner.num_kvcache_blocks
            assert runner.kv_cache.dtype == (FP8 if kv == "fp8" else getattr(torch, dtype))
            assert runner.kv_cache.numel() * runner.kv_cache.element_size() <= budget
            layer = runner.attention_layers[0]
            assert (layer.k_scale is None) == (kv == "auto")
            if kv == "fp8":
                assert layer.k_scale.shape == (runner.num_kv_heads,) and layer.k_scale.dtype == torch.float32
    assert counts["bfloat16", "auto"] == 40
    assert counts["bfloat16", "fp8"] == counts["float32", "fp8"] == 2 * counts["bfloat16", "auto"] == 4 * counts["float32", "auto"]


# ---- kernels against the reference ----

SEQS = [(10, 10), (13, 4), (6, 1), (9, 1)]  # (context_len, q_len): prefill, prefill after a prefix, decode
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
K_SCALE, V_SCALE = (0.5, 0.03), (1.0, 0.004)  # per kv head: heads of different magnitudes, some values clamped


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
    store(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    q = torch.randn(sum(n for _, n in SEQS), HEADS, HEAD_DIM, generator=g)
    cu = torch.tensor([0] + [sum(n for _, n in SEQS[: i + 1]) for i in range(len(SEQS))], dtype=torch.int32)
    return dict(k=k, v=v, q=q.to(DEVICE), k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, k_scale=k_scale,
                v_scale=v_scale, cu_seqlens_q=cu.to(DEVICE), context_lens=torch.tensor([c for c, _ in SEQS], dtype=torch.int32, device=DEVICE),
                block_tables=block_tables.to(DEVICE))


def test_store_kernel_quantizes_like_the_reference(tri):
    got, want = fp8_case(tri.store_kvcache), fp8_case(ref.store_kvcache)
    for name in ("k_cache", "v_cache"):
        g, w = got[name].view(torch.uint8), want[name].view(torch.uint8)
        if HAS_CUDA:  # the GPU's fp32 division may round differently: a rare tie may land one e4m3 step away
            assert (g != w).float().mean() <= 1e-3
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0.125, atol=2**-9)
        else:
            assert torch.equal(g, w), name  # the same bytes: round to nearest even, saturated at +-448
    stored = want["k_cache"].float().abs()
    assert stored.max() == 448  # the clamp was hit
    assert 0 < stored[stored > 0].min() < 2**-6  # and a subnormal kept


def _attention(backend, case, decode: bool, **kwargs):
    scales = dict(k_scale=case["k_scale"], v_scale=case["v_scale"])
    if decode:
        last = case["cu_seqlens_q"][1:].long() - 1  # each sequence's last query: its decode step
        return backend.paged_decode_attention(case["q"][last], case["k_cache"], case["v_cache"], case["context_lens"],
                                              case["block_tables"], 0.3, **scales, **kwargs)
    return backend.paged_prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["cu_seqlens_q"], case["context_lens"],
                                           case["block_tables"], 0.3, max(n for _, n in SEQS), **scales, **kwargs)


@pytest.mark.parametrize("decode,kwargs", [(False, dict(BLOCK_M=16, BLOCK_N=16)), (True, dict(num_splits=1, BLOCK_N=16)),
                                           (True, dict(num_splits=2, BLOCK_N=16))], ids=["prefill", "decode", "decode-split"])
def test_kernels_read_fp8_like_the_reference(tri, decode, kwargs):
    """Same fp8 cache, same scales: the kernels apply the scales in registers (K's in the
    softmax scale, V's on the output), the reference to its gathered K/V; in float32 only the
    summation order differs."""
    case = fp8_case(ref.store_kvcache)
    got, want = _attention(tri, case, decode, **kwargs), _attention(ref, case, decode)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_kernels_under_bfloat16_match_the_reference_on_fp8(tri, decode):
    """Under bf16 the kernels widen an fp8 cache's tiles to fp16 (and q with them: _widen_to),
    not to bf16: still close to the reference, which dequantizes to bf16 and computes in float32.
    (Under the interpreter, bf16 tiles would not even be: it computes bf16 dots wrongly.)"""
    case = fp8_case(ref.store_kvcache, outliers=False)
    case["q"] = case["q"].to(torch.bfloat16)
    kwargs = dict(num_splits=2, BLOCK_N=16) if decode else dict(BLOCK_M=16, BLOCK_N=16)
    got, want = _attention(tri, case, decode, **kwargs), _attention(ref, case, decode)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_kernel_stores_its_new_tokens_like_store_kvcache(tri, num_splits):
    """The decode kernel writing each sequence's new (last) K/V itself quantizes them into the
    same bytes as the store kernel, and attends to them."""
    case = fp8_case(tri.store_kvcache, outliers=False)
    k_full, v_full = case["k_cache"].clone(), case["v_cache"].clone()
    ends = torch.tensor([sum(c for c, _ in SEQS[: i + 1]) - 1 for i in range(len(SEQS))])  # each sequence's last token
    slots = case["slot_mapping"][ends.to(DEVICE)]
    case["k_cache"].view(-1, KV_HEADS, HEAD_DIM)[slots] = 0  # not stored yet
    case["v_cache"].view(-1, KV_HEADS, HEAD_DIM)[slots] = 0
    new_kv = (case["k"][ends].to(DEVICE), case["v"][ends].to(DEVICE), slots)
    got = _attention(tri, case, True, num_splits=num_splits, BLOCK_N=16, new_kv=new_kv)
    assert torch.equal(case["k_cache"].view(torch.uint8), k_full.view(torch.uint8))
    assert torch.equal(case["v_cache"].view(torch.uint8), v_full.view(torch.uint8))
    torch.testing.assert_close(got, _attention(ref, case, True), atol=1e-5, rtol=1e-5)


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
    scales = {"k": torch.tensor(K_SCALE)[:, None], "v": torch.tensor(V_SCALE)[:, None]}  # (kv_heads, 1)
    rounded = {n: (x / scales[n]).clamp(-448, 448).to(FP8).float() * scales[n] for n, x in exact.items()}
    step = {n: 2**-4 * x.abs() + 2**-10 * scales[n] for n, x in exact.items()}  # half an e4m3 step, per value
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
    d = 0.3 * torch.einsum("qhd,khd->qhk", q, dk).amax(dim=-1)  # (tokens, heads), over every key: an upper bound
    bound = step["v"].amax() + exact["v"].abs().amax() * (torch.exp(2 * d) - 1)
    assert (error <= bound).all(), (error / bound).max()
    assert error.max() > 0


# ---- the engine ----


COURSE_MODEL = Path(__file__).resolve().parents[1] / "models" / "course-llama"
STORY_PROMPTS = ["a kind boy named", "a little cat who", "an old fisherman. One day,", "a girl named Mia. She loved",
                 "a brave fox named Rusty.", "two friends who"]


def test_engine_fp8_greedy_agrees_with_auto():
    """Prefix cache, chunked prefill and preemption in one run, on the default backend (the
    PyTorch reference on CPU, the Triton kernels with CUDA graphs on a GPU): the course model's
    greedy stories with an fp8 cache against the model's dtype, position by position until the
    first difference. Float32 on both devices, so that only fp8's rounding differs: in bfloat16
    the near-ties of some greedy choices flip under bf16's own rounding as well (on an H200 the
    bf16 engine agreed on 70% of these positions). (A random-weight model is a poor judge here:
    its top two logprobs are often within 0.1, so any rounding flips its argmax.)"""
    prefix = "Once upon a time, in a small village by the sea, there lived "
    options = dict(device=DEVICE, dtype="float32", max_model_len=64, kvcache_block_size=4, num_kvcache_blocks=24, max_num_batched_tokens=16, max_num_seqs=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for kv in ("auto", "fp8"):
        with LLM(str(COURSE_MODEL), kv_cache_dtype=kv, **options) as llm:
            tokens[kv] = [o["token_ids"] for o in llm.generate([prefix + p for p in STORY_PROMPTS], params, use_tqdm=False)]
            assert total(llm, "preemptions") > 0 and total(llm, "chunked_prefills") > 0 and total(llm, "prefix_hit_blocks") > 0
    agree = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(tokens["auto"], tokens["fp8"])]
    share = sum(agree) / sum(map(len, tokens["auto"]))
    assert share >= 0.9, f"fp8 agrees with auto on {share:.0%} of the positions before the first difference: {agree}"
