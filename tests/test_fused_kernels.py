"""The elementwise and sampling Triton kernels of nanovllm_final (kernels/norm_rope.py,
kernels/activation.py, kernels/sampling.py) against the PyTorch code of the layers that call
them on CUDA (RMSNorm, RotaryEmbedding, SiluAndMul, the Sampler).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by
conftest.py before triton is imported), so shapes are small. Inputs are strided views,
as in the model (q and k are slices of the fused qkv projection)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import random_prompts  # noqa: E402

from nanovllm_final import LLM, SamplingParams  # noqa: E402
from nanovllm_final.kernels import activation, dispatch, norm_rope, sampling  # noqa: E402
from nanovllm_final.layers.activation import SiluAndMul  # noqa: E402
from nanovllm_final.layers.norm import RMSNorm  # noqa: E402
from nanovllm_final.layers.rotary import RotaryEmbedding  # noqa: E402
from nanovllm_final.layers.sampler import Sampler, keyed_exponential, seed_keys, top_candidates  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def tol(dtype: torch.dtype) -> dict:
    # float32: only the order of the sum of squares differs. bf16: that order can flip the
    # rounding of the normalised value, which the weight then scales: up to two bf16 ulps.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2**-6}


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Close to the reference everywhere; on a GPU, bf16 results are bit-equal almost
    everywhere (the interpreter rounds bf16 by truncation, so only closeness holds there)."""
    out = out.cpu()
    torch.testing.assert_close(out, ref, **tol(ref.dtype))
    if DEVICE == "cuda" and ref.dtype == torch.bfloat16:
        assert (out != ref).float().mean() < 0.02, (
            "more than 2% of the elements differ from the reference"
        )


def reference(module, *args):
    """The layer's PyTorch path, run on CPU in the inputs' dtype."""
    cpu = [a.cpu() if isinstance(a, (torch.Tensor, torch.nn.Module)) else a for a in args]
    return module.cpu()(*cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 40])  # 40: not a power of two (masked lanes)
def test_rms_norm(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, eps=1e-6)
    norm.weight.data = (torch.randn(dim, generator=g) * 0.5 + 1).to(dtype)
    x = (torch.randn(5, 3 * dim, generator=g) * 3).to(dtype)[:, dim : 2 * dim]  # strided rows
    out = norm_rope.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert_matches(out, reference(norm, x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head(dtype):
    """q_norm / k_norm: (tokens, heads, head_dim) views with a token stride of the qkv row."""
    g = torch.Generator().manual_seed(1)
    heads, head_dim = 3, 16
    norm = RMSNorm(head_dim, eps=1e-6)
    norm.weight.data = torch.rand(head_dim, generator=g).to(dtype) + 0.5
    qkv = torch.randn(7, (heads + 2) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(7, heads, head_dim)  # strides (80, 16, 1)
    out = norm_rope.rms_norm(q.to(DEVICE), norm.weight.to(DEVICE), norm.eps)
    assert out.shape == q.shape
    assert_matches(out, reference(norm, q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(2)
    dim = 48
    norm = RMSNorm(dim, eps=1e-5)
    norm.weight.data = (torch.randn(dim, generator=g) * 0.3 + 1).to(dtype)
    x = torch.randn(6, dim, generator=g).to(dtype)
    residual = (torch.randn(6, dim, generator=g) * 4).to(dtype)
    out, new_residual = norm_rope.rms_norm(
        x.to(DEVICE), norm.weight.to(DEVICE), norm.eps, residual.to(DEVICE)
    )
    ref_out, ref_residual = reference(norm, x, residual)
    assert_matches(new_residual, ref_residual)
    assert_matches(out, ref_out)
    assert not torch.equal(new_residual.cpu(), x)  # the residual was really added


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rotary(dtype, scaling):
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, tokens = 4, 2, 24, 9  # head_dim/2 = 12: masked lanes
    rope = RotaryEmbedding(head_dim, max_positions=512, theta=10000.0, scaling=scaling)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    q_out, k_out = norm_rope.rotary(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), rope.cos.to(DEVICE), rope.sin.to(DEVICE)
    )
    q_ref, k_ref = reference(rope, positions, q, k)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_matches(q_out, q_ref)
    assert_matches(k_out, k_ref)
    assert not torch.allclose(q_out.cpu().float(), q.float())  # positions > 0 rotate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 24])  # 24: head_dim/2 = 12, masked lanes
def test_qk_norm_rotary(dtype, head_dim):
    """Qwen3's q_norm, k_norm and RoPE in one launch, from the qkv projection's strided views,
    against the layers' PyTorch code one after the other."""
    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, tokens = 4, 2, 9
    rope = RotaryEmbedding(head_dim, max_positions=512, theta=1000000.0, scaling=None)
    q_norm, k_norm = RMSNorm(head_dim, eps=1e-6), RMSNorm(head_dim, eps=1e-6)
    q_norm.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    k_norm.weight.data = (torch.randn(head_dim, generator=g) * 0.3 + 1).to(dtype)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    q_out, k_out = norm_rope.rotary(
        positions.to(DEVICE),
        q.to(DEVICE),
        k.to(DEVICE),
        rope.cos.to(DEVICE),
        rope.sin.to(DEVICE),
        (q_norm.weight.to(DEVICE), k_norm.weight.to(DEVICE)),
        1e-6,
    )
    q_ref, k_ref = reference(rope, positions, q, k, q_norm, k_norm)
    torch.testing.assert_close(
        q_ref, rope(positions, q_norm(q), k_norm(k))[0]
    )  # the reference: norm, then rotate
    assert (
        q_out.shape == q.shape
        and k_out.shape == k.shape
        and q_out.is_contiguous()
        and k_out.is_contiguous()
    )
    assert_matches(q_out, q_ref)
    assert_matches(k_out, k_ref)
    q_plain, k_plain = reference(rope, positions, q, k)  # rotated without the norms: far from it
    assert not torch.allclose(q_out.cpu().float(), q_plain.float(), atol=0.1)
    assert not torch.allclose(k_out.cpu().float(), k_plain.float(), atol=0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [32, 1500])  # 1500: two column tiles, the last one masked
def test_silu_and_mul(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 2 * n, generator=g) * 3).to(dtype)
    out = activation.silu_and_mul(x.to(DEVICE))
    assert out.shape == (3, n)
    assert_matches(out, reference(SiluAndMul(), x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [300, 5000])  # 5000: two chunks of 4096, the last one masked
def test_gumbel_argmax_draws_the_samplers_tokens(dtype, vocab):
    """The temperature-only draw, hashing its noise from the rows' keys, against the Sampler's
    PyTorch code for seeded rows with those keys: the same token in every row, greedy rows
    (T = 0) with tied logits included."""
    g = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[::3] = torch.randint(-3, 4, (len(logits[::3]), vocab), generator=g).to(
        dtype
    )  # many tied maxima
    logits[1, : vocab // 2] = float("-inf")  # suppressed tokens (min_tokens)
    logits[3, : vocab - 200] = -10.0  # a greedy row whose tied maxima are all in the last chunk
    temperatures = torch.tensor([0.0, 0.6, 1.0, 0.0, 1.3, 0.2, 0.0, 1e-7, 0.9, 0.0, 2.0, 0.7] * 2)
    seeds, positions = (
        torch.randint(0, 2**40, (rows,), generator=g),
        torch.randint(0, 999, (rows,), generator=g),
    )
    keys = seed_keys(
        seeds, positions
    )  # (rows,): the Sampler's noise for them is keyed_exponential(keys, ids)
    out = sampling.gumbel_argmax(logits.to(DEVICE), keys.to(DEVICE), temperatures.to(DEVICE))
    expected = Sampler(seed=0, device=torch.device("cpu"))(
        logits, temperatures, seeds=seeds, positions=positions
    )
    assert out.dtype == torch.int64 and torch.equal(out.cpu(), expected)
    greedy = temperatures == 0
    assert torch.equal(out.cpu()[greedy], logits[greedy].argmax(-1))  # the first of the tied maxima
    assert not torch.equal(out.cpu()[~greedy], logits[~greedy].argmax(-1))  # the noise draws
    assert vocab <= 4096 or (out >= 4096).any()  # some rows draw from the second chunk


def test_gumbel_argmax_hashes_the_noise_of_keyed_exponential():
    """With equal logits the draw is the token of least noise: for keys of every size (0, the
    largest, random 32-bit ones) the kernel's hash picks keyed_exponential's minimum, over two
    chunks of the vocabulary."""
    vocab = 6000
    keys = torch.cat(
        [
            torch.tensor([0, 2**32 - 1, 2**31]),
            torch.randint(0, 2**32, (13,), generator=torch.Generator().manual_seed(1)),
        ]
    )
    out = sampling.gumbel_argmax(
        torch.zeros(len(keys), vocab, device=DEVICE),
        keys.to(DEVICE),
        torch.ones(len(keys), device=DEVICE),
    )
    assert torch.equal(out.cpu(), keyed_exponential(keys, torch.arange(vocab)).argmin(-1))


@pytest.mark.parametrize("masks", ["top_k", "top_k+top_p", "top_k+top_p+min_p", "top_p+min_p"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_candidates_draw_draws_the_samplers_tokens(masks, dtype):
    """The draw among the top-k candidates, hashing its noise from the rows' keys, against the
    Sampler's PyTorch code for its max_k path for seeded rows with those keys: the same token in every row, with tied candidates,
    suppressed (-inf) tokens, top_p 1 and min_p 0 (off) rows and a k that is not a power of two."""
    g = torch.Generator().manual_seed(len(masks))
    rows, vocab, k = 32, 600, 20
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    logits[::4] = torch.randint(-2, 3, (len(logits[::4]), vocab), generator=g).to(
        dtype
    )  # many tied candidates
    logits[1, :500] = float("-inf")  # suppressed tokens: 100 finite ones left
    logits[2, 20:] = float("-inf")  # exactly k finite candidates
    temperatures = torch.rand(rows, generator=g) * 1.5 + 0.05
    top_k = torch.randint(1, k + 1, (rows,), generator=g) if "top_k" in masks else None
    top_p = (
        torch.where(torch.rand(rows, generator=g) < 0.2, 1.0, torch.rand(rows, generator=g))
        if "top_p" in masks
        else None
    )
    min_p = (
        torch.where(torch.rand(rows, generator=g) < 0.2, 0.0, torch.rand(rows, generator=g) * 0.3)
        if "min_p" in masks
        else None
    )
    seeds, positions = (
        torch.randint(0, 2**40, (rows,), generator=g),
        torch.randint(0, 999, (rows,), generator=g),
    )
    expected = Sampler(seed=0, device=torch.device("cpu"))(
        logits,
        temperatures,
        top_k,
        top_p,
        min_p,
        seeds=seeds,
        positions=positions,
        max_k=k,
        greedy_rows=False,
    )
    values, ids = top_candidates(logits, k)  # (rows, k): what the max_k path draws among

    def on(t):
        return None if t is None else t.to(DEVICE)

    out = sampling.candidates_draw(
        values.to(DEVICE),
        ids.to(DEVICE),
        seed_keys(seeds, positions).to(DEVICE),
        temperatures.to(DEVICE),
        on(top_k),
        on(top_p),
        on(min_p),
    )
    assert out.dtype == torch.int64 and torch.equal(out.cpu(), expected)
    assert len(set(out.tolist())) > rows // 2  # the draws differ from row to row
    assert not torch.equal(out.cpu(), ids[:, 0])  # not just each row's most likely token


@pytest.mark.skipif(DEVICE == "cpu", reason="compares the Sampler's CUDA path with its CPU one")
def test_sampler_on_the_device_draws_the_cpu_samplers_tokens():
    """The Sampler as the engine calls it with the checkpoint's masks (top-k 20, top-p 0.95), on
    DEVICE (on CUDA: top_candidates' grouped pass and candidates_draw) and on the CPU: with
    every row seeded, the same tokens; greedy rows (T = 0) take the argmax."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 16, 151936
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(torch.bfloat16)
    temperatures = torch.tensor([0.6] * 12 + [0.0] * 4)
    top_k, top_p = torch.full((rows,), 20), torch.full((rows,), 0.95)
    seeds, positions = torch.randint(0, 2**40, (rows,), generator=g), torch.arange(rows)
    args = (temperatures, top_k, top_p, None, seeds, positions)

    def draw(device):
        return Sampler(seed=0, device=torch.device(device))(
            logits.to(device),
            *(None if a is None else a.to(device) for a in args),
            max_k=20,
            greedy_rows=True,
        ).cpu()

    expected = draw("cpu")
    assert torch.equal(draw(DEVICE), expected)
    assert torch.equal(expected[12:], logits[12:].argmax(-1))


def test_empty_batch():
    x = torch.empty(0, 8, device=DEVICE)
    assert norm_rope.rms_norm(x, torch.ones(8, device=DEVICE), 1e-6).shape == (0, 8)
    assert activation.silu_and_mul(x).shape == (0, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layers use the kernels on CUDA only")
def test_layers_dispatch_to_kernels_on_cuda():
    """On CUDA the layers' forward is the kernel's result, equal to their CPU reference path."""
    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(128, eps=1e-6).cuda().to(torch.bfloat16)
    x = torch.randn(33, 128, generator=g).to(torch.bfloat16)
    assert_matches(norm(x.cuda()), reference(norm, x))
    # Qwen3's attention input: q_norm, k_norm and RoPE in the rotary layer's one launch
    rope = RotaryEmbedding(128, max_positions=4096, theta=1000000.0, scaling=None).cuda()
    q_norm, k_norm = (RMSNorm(128, eps=1e-6).cuda().to(torch.bfloat16) for _ in range(2))
    q_norm.weight.data = (torch.rand(128, generator=g) + 0.5).to(torch.bfloat16).cuda()
    qkv = torch.randn(33, 32 * 128, generator=g).to(torch.bfloat16)
    q, k = qkv[:, : 16 * 128].view(33, 16, 128), qkv[:, 16 * 128 : 24 * 128].view(33, 8, 128)
    positions = torch.randint(0, 4096, (33,), generator=g)
    q_out, k_out = rope(positions.cuda(), q.cuda(), k.cuda(), q_norm, k_norm)
    q_ref, k_ref = reference(rope, positions, q, k, q_norm, k_norm)
    assert_matches(q_out, q_ref)
    assert_matches(k_out, k_ref)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Sampler uses the kernel on CUDA only"
)
def test_sampler_draws_the_same_tokens_with_the_kernel():
    """A decode-sized batch (bf16 logits; seeded, greedy and unseeded rows): the fused draw
    equals the Sampler's PyTorch code on the same device, token for token, in the seeded and
    greedy rows; the unseeded rows draw from the generator's keys, again the same for the same seed."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 256, 151936
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 3).to(torch.bfloat16)
    temperatures = torch.rand(rows, generator=g, device="cuda") + 0.3
    temperatures[::7] = 0
    seeds = torch.where(
        torch.arange(rows, device="cuda") % 3 == 0, torch.arange(rows, device="cuda"), -1
    )
    positions = torch.randint(0, 999, (rows,), generator=g, device="cuda")
    assert dispatch.use_kernel(logits)
    draws = [
        Sampler(seed=1, device=torch.device("cuda"))(
            logits, temperatures, seeds=seeds, positions=positions
        )
    ]
    with dispatch.reference_only():
        draws.append(
            Sampler(seed=1, device=torch.device("cuda"))(
                logits, temperatures, seeds=seeds, positions=positions
            )
        )
    same = (seeds >= 0) | (temperatures == 0)
    assert torch.equal(draws[0][same], draws[1][same])
    assert (
        draws[0] != logits.argmax(-1)
    ).sum() > rows // 2  # the sampled rows mostly leave the argmax
    again = Sampler(seed=1, device=torch.device("cuda"))(
        logits, temperatures, seeds=seeds, positions=positions
    )
    assert torch.equal(again, draws[0])
    other = Sampler(seed=2, device=torch.device("cuda"))(
        logits, temperatures, seeds=seeds, positions=positions
    )
    assert (other != draws[0])[~same].sum() > (~same).sum() // 2  # another seed, other keys


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs and the kernels' dispatch need a GPU"
)
def test_qwen3_graphs_with_the_kernels_equal_the_reference_layers(model_dir):
    """Qwen3 (q/k norm) in float32: CUDA-graph decode steps with every fused kernel give the
    tokens the eager engine gives with the layers', the attention's and the sampler's PyTorch code, for greedy
    rows and for seeded temperature-only rows (drawn by the sampler's kernel)."""
    prompts = random_prompts([5 + i % 11 for i in range(12)], seed=9)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=16, ignore_eos=True)
        for i in range(12)
    ]
    options = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=16)
    with LLM(model_dir("qwen3"), **options) as llm:
        fused = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.model_runner.num_graph_replays > 0
    # every layer's PyTorch code (cuBLAS for the projections and the MLP of a few rows too), and the
    # PyTorch attention: the Triton decode kernel applies q/k norms and RoPE itself
    with (
        dispatch.reference_only(),
        LLM(model_dir("qwen3"), enforce_eager=True, attention_backend="torch", **options) as llm,
    ):
        reference = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused == reference


def test_pdl_is_off_on_cpu():
    """Programmatic dependent launch (kernels/launch.py) is a CUDA launch option: on a CPU tensor the
    kernels take no wait and no launch_pdl."""
    from nanovllm_final.kernels import launch

    assert launch.pdl_args(torch.device("cpu")) == {"PDL": False}
