"""The final engine's CPU fast paths against what they replace: the torch backend's batched
attention against paged_attention (its per-sequence reference), and cpu_linear.linear against
F.linear."""

import pytest
import torch
import torch.nn.functional as F

from nanovllm_final.layers import attention_torch as ref
from nanovllm_final.layers import cpu_linear


def paged_case(seqs, block_size=4, heads=8, kv_heads=2, dim=16, seed=0):
    """seqs: (context_len, q_len) each. A NaN-poisoned cache with each sequence's K/V in shuffled
    blocks (tables padded with -1), and its last q_len queries packed."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-c // block_size) for c, _ in seqs]
    num_blocks = sum(counts) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.full((len(seqs), max(counts) + 1), -1, dtype=torch.int32)
    for i, ((ctx, _), n) in enumerate(zip(seqs, counts)):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
        slots = (
            tables[i].long()[torch.arange(ctx) // block_size] * block_size
            + torch.arange(ctx) % block_size
        )
        k_cache.view(-1, kv_heads, dim)[slots] = torch.randn(ctx, kv_heads, dim, generator=g)
        v_cache.view(-1, kv_heads, dim)[slots] = torch.randn(ctx, kv_heads, dim, generator=g)
    q = torch.randn(sum(n for _, n in seqs), heads, dim, generator=g)
    cu = F.pad(torch.tensor([n for _, n in seqs]).cumsum(0), (1, 0)).to(torch.int32)
    lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32)
    return q, k_cache, v_cache, cu, lens, tables


@pytest.mark.parametrize(
    "seqs",
    [
        [(9, 1)],  # one decoding sequence
        [(9, 1), (30, 1), (1, 1), (17, 1)],  # a decode batch of uneven contexts
        [(12, 5)],  # a verify step: 1 + 4 tokens
        [(12, 5), (33, 5), (5, 5)],  # verify steps of several sequences
        [(20, 20), (13, 3), (7, 0), (40, 1)],  # a mixed step: a prompt, a chunk, nothing, a decode
    ],
)
def test_batched_attention_matches_the_reference(seqs):
    q, k_cache, v_cache, cu, lens, tables = paged_case(seqs)
    want = ref.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.3)
    got = ref.paged_prefill_attention(
        q, k_cache, v_cache, cu, lens, tables, 0.3, max(n for _, n in seqs)
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if all(n == 1 for _, n in seqs):
        got = ref.paged_decode_attention(q, k_cache, v_cache, lens, tables, 0.3)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batched_attention_in_chunks(monkeypatch):
    """A step larger than SCORES_PER_CHUNK runs in chunks of sequences: the same outputs."""
    seqs = [(c, 1) for c in (5, 19, 2, 31, 8, 12, 1)]
    q, k_cache, v_cache, cu, lens, tables = paged_case(seqs, seed=2)
    whole = ref.paged_decode_attention(q, k_cache, v_cache, lens, tables, 0.3)
    monkeypatch.setattr(ref, "SCORES_PER_CHUNK", 2 * 8 * 31)  # two sequences a chunk
    torch.testing.assert_close(
        ref.paged_decode_attention(q, k_cache, v_cache, lens, tables, 0.3), whole
    )


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_f_linear(rows, bias, monkeypatch):
    monkeypatch.setattr(cpu_linear, "ONEDNN_CPU", True)  # the oneDNN path on any CPU
    g = torch.Generator().manual_seed(rows)
    w = torch.nn.Parameter(torch.randn(512, 256, generator=g))  # large enough for oneDNN
    b = torch.randn(512, generator=g) if bias else None
    x = torch.randn(rows, 256, generator=g)
    torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # a changed weight is packed again
        w.mul_(-2)
    torch.testing.assert_close(cpu_linear.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    assert (
        cpu_linear.linear(x.double(), w.double()).dtype == torch.float64
    )  # other dtypes: F.linear
    if cpu_linear.AVAILABLE and rows > 1:
        assert w.onednn_packed[0] == w._version  # the product ran on the packed copy


def test_cpu_linear_takes_onednn_on_amd_cpus_only(monkeypatch):
    vendor = cpu_linear.cpu_vendor()
    assert vendor is None or vendor.isprintable()
    assert cpu_linear.onednn_cpu("", "AuthenticAMD") and cpu_linear.onednn_cpu("1", "GenuineIntel")
    assert not cpu_linear.onednn_cpu("", "GenuineIntel") and not cpu_linear.onednn_cpu("", None)
    assert not cpu_linear.onednn_cpu("0", "AuthenticAMD")
    monkeypatch.setattr(cpu_linear, "ONEDNN_CPU", False)  # as on an Intel CPU: MKL's F.linear
    w = torch.nn.Parameter(torch.randn(512, 256))
    x = torch.randn(5, 256)
    torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=0, rtol=0)
    assert not hasattr(w, "onednn_packed")
