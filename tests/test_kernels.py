"""Triton paged-attention kernels vs the plain-PyTorch reference (and the reference vs SDPA).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set below
before anything imports triton), so shapes here are kept small. The GPU-only test at the
end uses realistic shapes and bf16.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of a kernel module

import hashlib  # noqa: E402
import importlib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import stages  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
ROOT = Path(stages.__file__).parent


FINAL = {
    "attention_triton": "nanovllm_final.kernels.attention",
    "attention_torch": "nanovllm_final.layers.attention_torch",
}


def _kernel_stages() -> list[str]:
    """Every stage with layers/attention_triton.py, and final (kernels/attention.py); byte-identical
    copies (same triton and torch files as an earlier stage) are tested once, under the first stage
    that has them."""
    seen, picked = set(), []
    for name in [*stages.names(), "final"]:
        final = ROOT.parent / "nanovllm_final"
        layers = ROOT / name / "layers"
        paths = (
            (final / "kernels" / "attention.py", final / "layers" / "attention_torch.py")
            if name == "final"
            else (layers / "attention_triton.py", layers / "attention_torch.py")
        )
        if not paths[0].exists():
            continue
        key = tuple(hashlib.sha1(path.read_bytes()).hexdigest() for path in paths)
        if key not in seen:
            seen.add(key)
            picked.append(name)
    return picked


KERNEL_STAGES = _kernel_stages()


def _load(stage: str, name: str):
    mod = importlib.import_module(
        FINAL[name] if stage == "final" else f"stages.{stage}.layers.{name}"
    )
    if name == "attention_triton" and not HAS_CUDA:
        # If something imported the module before TRITON_INTERPRET was set, its kernels are
        # compiled-mode JITFunctions that cannot run on a CPU: re-import them interpreted.
        if type(mod._store_kvcache_kernel).__name__ != "InterpretedFunction":
            mod = importlib.reload(mod)
    return mod


@pytest.fixture(params=KERNEL_STAGES)
def mods(request):
    """(triton module, torch reference module) of one stage."""
    return _load(request.param, "attention_triton"), _load(request.param, "attention_torch")


# --------------------------------------------------------------------------------------
# Building a paged cache
# --------------------------------------------------------------------------------------


def make_paged(
    seqs,
    block_size,
    heads,
    kv_heads,
    head_dim,
    dtype=torch.float32,
    device=DEVICE,
    seed=0,
    poison=True,
):
    """A random batch on a paged cache.

    seqs: list of (context_len, q_len). Blocks are handed out in a shuffled order with
    spare blocks, block tables are padded with -1, and every cache slot that is not part
    of a context is filled with NaN (fp32) so a kernel that reads past a context fails.
    Returns a dict with q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
    the contiguous per-sequence K/V (ks, vs) and the queries per sequence (qs).
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(c + block_size - 1) // block_size for c, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    max_blocks = max(blocks_per_seq + [1]) + 1  # at least one -1 of padding
    fill = float("nan") if (poison and dtype == torch.float32) else 0.0
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), fill, dtype=dtype)
    v_cache = torch.full_like(k_cache, fill)
    block_tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks, generator=g).tolist()
    ks, vs, qs = [], [], []
    for i, (ctx, q_len) in enumerate(seqs):
        ids = [free.pop() for _ in range(blocks_per_seq[i])]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, kv_heads, head_dim, generator=g)
        pos = torch.arange(ctx)
        slots = (
            torch.tensor(ids, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        )
        k_cache.view(-1, kv_heads, head_dim)[slots] = k.to(dtype)
        v_cache.view(-1, kv_heads, head_dim)[slots] = v.to(dtype)
        ks.append(k.to(dtype))
        vs.append(v.to(dtype))
        qs.append(torch.randn(q_len, heads, head_dim, generator=g).to(dtype))
    cu = [0]
    for _, q_len in seqs:
        cu.append(cu[-1] + q_len)
    return dict(
        q=torch.cat(qs).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        ks=ks,
        vs=vs,
        qs=qs,
    )


def dense_causal(q, k, v, scale):
    """SDPA on contiguous tensors: q (q_len, H, D) are the last q_len of k/v (ctx, KVH, D)."""
    group = q.shape[1] // k.shape[1]
    q_len, ctx = q.shape[0], k.shape[0]
    qt = q.float().transpose(0, 1)  # (H, q_len, D)
    kt = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # (H, ctx, D)
    vt = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    if q_len == ctx:
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale
        )
    else:  # bottom-right aligned causal mask
        mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
        out = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask.to(q.device), scale=scale
        )
    return out.transpose(0, 1)


MIXED = [(10, 10), (13, 4), (6, 1), (1, 1), (20, 20), (40, 18)]  # (context_len, q_len)
SHAPES = [(4, 2, 16), (2, 2, 24), (4, 2, 24), (2, 2, 16)]  # (heads, kv_heads, head_dim)


# --------------------------------------------------------------------------------------
# The reference checks itself against dense attention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 3, 24)])
def test_reference_matches_dense_sdpa(mods, block_size, heads, kv_heads, head_dim):
    _, ref = mods
    case = make_paged(MIXED, block_size, heads, kv_heads, head_dim, device="cpu")
    out = ref.paged_attention(
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["cu_seqlens_q"],
        case["context_lens"],
        case["block_tables"],
        0.37,
    )
    cu = case["cu_seqlens_q"].tolist()
    for i, (q, k, v) in enumerate(zip(case["qs"], case["ks"], case["vs"])):
        torch.testing.assert_close(
            out[cu[i] : cu[i + 1]], dense_causal(q, k, v, 0.37), atol=1e-5, rtol=1e-5
        )


def test_reference_prefix_equals_tail_of_full_prefill(mods):
    """Queries after a cached prefix see exactly what they would in one full prefill."""
    _, ref = mods
    ctx, q_len = 11, 4
    full = make_paged([(ctx, ctx)], 3, 4, 2, 16, device="cpu")
    tail = dict(
        full, q=full["q"][-q_len:], cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32)
    )
    args = ("k_cache", "v_cache", "cu_seqlens_q", "context_lens", "block_tables")
    out_full = ref.paged_attention(full["q"], *[full[a] for a in args], 0.25)
    out_tail = ref.paged_attention(tail["q"], *[tail[a] for a in args], 0.25)
    torch.testing.assert_close(out_tail, out_full[-q_len:], atol=1e-6, rtol=1e-6)


def test_reference_store(mods):
    _, ref = mods
    k_cache = torch.zeros(3, 2, 2, 4)
    v_cache = torch.zeros(3, 2, 2, 4)
    key, value = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    ref.store_kvcache(key, value, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(k_cache[2, 1], key[0]) and torch.equal(v_cache[0, 0], value[2])
    written = (k_cache != 0).flatten(2).any(-1)  # (num_blocks, block_size)
    assert written.sum() == 2  # the token with slot -1 wrote nothing


# --------------------------------------------------------------------------------------
# Triton vs reference
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kvcache(mods, slot_dtype, dtype):
    tri, ref = mods
    num_tokens, kv_heads, head_dim, block_size, num_blocks = 7, 2, 24, 3, 5
    g = torch.Generator().manual_seed(1)
    # key/value as column slices of a fused qkv tensor: non-contiguous rows, like in a model
    qkv = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([4, -1, 0, 14, 7, -1, 9], dtype=slot_dtype, device=DEVICE)
    caches = [
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
        for _ in range(2)
    ]
    k_tri, v_tri = caches[0].clone(), caches[1].clone()
    k_ref, v_ref = caches[0].clone(), caches[1].clone()
    tri.store_kvcache(key, value, k_tri, v_tri, slots)
    ref.store_kvcache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    # the -1 tokens wrote nothing: only 5 slots changed
    changed = (k_tri != caches[0]).flatten(2).any(-1).flatten()
    assert changed.sum() == 5


def _prefill_args(case):
    return (
        case["q"],
        case["k_cache"],
        case["v_cache"],
        case["cu_seqlens_q"],
        case["context_lens"],
        case["block_tables"],
    )


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_prefill_matches_reference(mods, block_size, heads, kv_heads, head_dim):
    tri, ref = mods
    case = make_paged(MIXED, block_size, heads, kv_heads, head_dim)
    max_q = max(q for _, q in MIXED)
    expected = ref.paged_attention(*_prefill_args(case), 0.3)
    out = tri.paged_prefill_attention(*_prefill_args(case), 0.3, max_q, BLOCK_M=16, BLOCK_N=16)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 64)])
def test_prefill_tile_sizes(mods, block_m, block_n):
    tri, ref = mods
    seqs = [(70, 70), (45, 9), (3, 1), (33, 33)]
    case = make_paged(seqs, 5, 4, 2, 16, seed=3)
    expected = ref.paged_attention(*_prefill_args(case), 0.25)
    out = tri.paged_prefill_attention(
        *_prefill_args(case), 0.25, 70, BLOCK_M=block_m, BLOCK_N=block_n
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_prefill_empty_sequence_in_batch(mods):
    """A sequence with no queries (q_len 0) is skipped without disturbing the others."""
    tri, ref = mods
    seqs = [(9, 9), (5, 0), (7, 2)]
    case = make_paged(seqs, 4, 2, 2, 16, seed=4)
    expected = ref.paged_attention(*_prefill_args(case), 0.5)
    out = tri.paged_prefill_attention(*_prefill_args(case), 0.5, 9, BLOCK_M=16, BLOCK_N=16)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def _unrotated_step(rope, dtype, tokens, heads, kv_heads, head_dim, g):
    """A step's rotary layer, its q/k norms (with "norm+rope": random weights from `g`, else None)
    and its q, new K and new V as the qkv projection gives them: slices of one tensor."""
    from nanovllm_final.layers.norm import RMSNorm
    from nanovllm_final.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    norms = [RMSNorm(head_dim, 1e-6) for _ in range(2)] if rope == "norm+rope" else [None, None]
    for norm in norms:
        if norm is not None:
            norm.weight.data = (torch.rand(head_dim, generator=g) + 0.5).to(dtype)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    q, new_k, new_v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    return rotary, norms, q, new_k, new_v


VERIFY = [(10, 3), (13, 5), (6, 1), (1, 1), (0, 0), (33, 5), (40, 5), (60, 4)]  # 1 + k each


def _several_queries(case, max_q, num_splits):
    """The final engine's decode launch taking each sequence's queries of `case` (packed)."""
    return dict(
        cu_seqlens_q=case["cu_seqlens_q"], max_seqlen_q=max_q, num_splits=num_splits, BLOCK_N=16
    )


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 16), (4, 4, 24)])
def test_decode_takes_several_queries_per_sequence(heads, kv_heads, head_dim, num_splits):
    """The final engine's decode kernel with cu_seqlens_q attends each sequence's last few
    positions (a verify step's 1 + k; a sequence with none, as a CUDA graph's padding), causally,
    as the reference does: the split-K cut and its merge hold with several queries a row."""
    tri, ref = _load("final", "attention_triton"), _load("final", "attention_torch")
    case = make_paged(VERIFY, 4, heads, kv_heads, head_dim, seed=1)
    expected = ref.paged_attention(*_prefill_args(case), 0.3)
    out = tri.paged_decode_attention(
        *_decode_args(case), 0.3, **_several_queries(case, 5, num_splits)
    )
    assert out.shape == case["q"].shape
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["prefill", "decode"])
@pytest.mark.parametrize("rope", [None, "rope", "norm+rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_stores_and_rotates_the_new_tokens(dtype, rope, kernel):
    """The final engine's prefill with `new_kv` stores each sequence's new K/V (its last q_len
    positions) before it attends; with `rope` the same launch first applies the rotary embedding
    (after Qwen3's q/k norms) to q and the new K, as the rotary layer would. The cache ends up as
    rotary + store_kvcache leave it and the output is the reference's. A padding token past the
    last sequence (slot -1) writes nothing. So does the decode kernel given a few queries per
    sequence (with splits: its last split stores them all)."""
    tri, ref = _load("final", "attention_triton"), _load("final", "attention_torch")
    heads, kv_heads, head_dim, block = 8, 2, 16, 4
    seqs = MIXED if kernel == "prefill" else VERIFY
    case = make_paged(seqs, block, heads, kv_heads, head_dim, dtype=dtype, seed=5)
    g = torch.Generator().manual_seed(2)
    news = [torch.arange(c - n, c) for c, n in seqs]  # each sequence's new positions
    positions = torch.cat(news + [torch.zeros(1, dtype=torch.long)])  # and a padding token's
    tables = case["block_tables"].cpu().long()
    slots = torch.cat(
        [tables[i, p // block] * block + p % block for i, p in enumerate(news)]
        + [torch.tensor([-1])]
    )
    # the step's inputs and a padding token's
    rotary, norms, q, new_k, new_v = _unrotated_step(
        rope, dtype, len(slots), heads, kv_heads, head_dim, g
    )
    q_rot, k_rot = rotary(positions, q, new_k, *norms) if rope else (q, new_k)
    k_full, v_full = case["k_cache"].clone(), case["v_cache"].clone()
    ref.store_kvcache(k_rot.to(DEVICE), new_v.to(DEVICE), k_full, v_full, slots.to(DEVICE))
    args = (case["cu_seqlens_q"], case["context_lens"], case["block_tables"])
    expected = ref.paged_attention(q_rot[:-1].to(DEVICE), k_full, v_full, *args, 0.3)
    for cache in (case["k_cache"], case["v_cache"]):  # the new tokens are not in the cache yet
        cache.view(-1, kv_heads, head_dim)[slots[:-1].to(DEVICE)] = (
            float("nan") if dtype == torch.float32 else 7.0
        )
    extra = {}
    if rope:
        extra["rope"] = rotary.to(DEVICE).kernel_args(
            positions.to(DEVICE), *[n and n.to(DEVICE) for n in norms]
        )
    new_kv = (new_k.to(DEVICE), new_v.to(DEVICE), slots.to(DEVICE))
    caches = (case["k_cache"], case["v_cache"])
    max_q = max(n for _, n in seqs)
    if kernel == "prefill":
        out = tri.paged_prefill_attention(
            q.to(DEVICE), *caches, *args, 0.3, max_q, BLOCK_M=16, BLOCK_N=16, new_kv=new_kv, **extra
        )
    else:
        out = tri.paged_decode_attention(
            q.to(DEVICE),
            *caches,
            *args[1:],
            0.3,
            new_kv=new_kv,
            **extra,
            **_several_queries(case, max_q, 3),
        )
    torch.testing.assert_close(case["k_cache"], k_full, equal_nan=True, atol=1e-6, rtol=1e-6)
    assert torch.equal(case["v_cache"].nan_to_num(), v_full.nan_to_num())
    torch.testing.assert_close(out[:-1], expected, atol=1e-3, rtol=1e-3)
    if rope:  # the rotation mattered
        assert not torch.allclose(q_rot.float(), q.float(), atol=0.05)


DECODE_CTX = [1, 5, 17, 40, 33]


def _decode_case(
    block_size,
    heads,
    kv_heads,
    head_dim,
    seed=0,
    ctxs=DECODE_CTX,
    dtype=torch.float32,
    device=DEVICE,
):
    return make_paged(
        [(c, 1) for c in ctxs],
        block_size,
        heads,
        kv_heads,
        head_dim,
        dtype=dtype,
        device=device,
        seed=seed,
    )


def _decode_args(case):
    return case["q"], case["k_cache"], case["v_cache"], case["context_lens"], case["block_tables"]


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_decode_matches_reference(mods, block_size, heads, kv_heads, head_dim, num_splits):
    tri, ref = mods
    case = _decode_case(block_size, heads, kv_heads, head_dim)
    expected = ref.paged_attention(*_prefill_args(case), 0.3)
    out = tri.paged_decode_attention(*_decode_args(case), 0.3, num_splits=num_splits, BLOCK_N=16)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # decode is the q_len == 1 special case of prefill: both kernels agree
    out_prefill = tri.paged_prefill_attention(*_prefill_args(case), 0.3, 1, BLOCK_M=16, BLOCK_N=16)
    torch.testing.assert_close(out, out_prefill, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_launch_order(num_splits):
    """The final engine's decode kernel can start sequences in any order (longest first, as
    the runner asks): the same outputs as in batch order, row for row."""
    tri, ref = _load("final", "attention_triton"), _load("final", "attention_torch")
    case = _decode_case(4, 8, 2, 16, seed=3, ctxs=[3, 70, 1, 33, 0, 12])
    expected = ref.paged_attention(*_prefill_args(case), 0.3)
    order = torch.argsort(case["context_lens"], descending=True, stable=True).to(torch.int32)
    assert order.tolist() != list(range(len(order)))  # a real permutation
    out = tri.paged_decode_attention(
        *_decode_args(case), 0.3, order, num_splits=num_splits, BLOCK_N=16
    )
    nonempty = case["context_lens"] > 0
    torch.testing.assert_close(out[nonempty], expected[nonempty], atol=1e-4, rtol=1e-4)
    assert torch.equal(out[~nonempty], torch.zeros_like(out[~nonempty]))


@pytest.mark.parametrize("rope", [None, "rope", "norm+rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_stores_and_rotates_the_new_tokens(num_splits, dtype, rope):
    """The final engine's decode kernel with `new_kv` writes each sequence's new K/V (its last
    position) into the cache itself, before reading it; with `rope` it first applies the rotary
    embedding (after Qwen3's q/k norms) to q and the new K, as the rotary layer would. The cache
    ends up as rotary + store_kvcache leave it and the output is the reference's. A padding row
    (context 0, slot -1) writes nothing; with splits, the counters the last split merges by are
    reset for the next launch."""
    tri, ref = _load("final", "attention_triton"), _load("final", "attention_torch")
    heads, kv_heads, head_dim, block = 8, 2, 16, 4
    case = _decode_case(
        block, heads, kv_heads, head_dim, seed=7, ctxs=[1, 5, 17, 40, 0, 33], dtype=dtype
    )
    g = torch.Generator().manual_seed(1)
    ctxs = case["context_lens"].tolist()
    positions = torch.tensor([max(c - 1, 0) for c in ctxs])
    rotary, norms, q, new_k, new_v = _unrotated_step(
        rope, dtype, len(ctxs), heads, kv_heads, head_dim, g
    )
    q_rot, k_rot = (
        rotary(positions, q, new_k, *norms) if rope else (q, new_k)
    )  # the layers' PyTorch code
    slots = torch.tensor(
        [
            int(case["block_tables"][i, (c - 1) // block]) * block + (c - 1) % block if c else -1
            for i, c in enumerate(ctxs)
        ]
    )
    k_full, v_full = case["k_cache"].clone(), case["v_cache"].clone()
    ref.store_kvcache(k_rot.to(DEVICE), new_v.to(DEVICE), k_full, v_full, slots.to(DEVICE))
    expected = ref.paged_attention(q_rot.to(DEVICE), k_full, v_full, *_prefill_args(case)[3:], 0.3)
    for cache in (case["k_cache"], case["v_cache"]):  # the new token is not in the cache yet
        cache.view(-1, kv_heads, head_dim)[slots[slots >= 0].to(DEVICE)] = (
            float("nan") if dtype == torch.float32 else 7.0
        )
    extra = (
        {
            "rope": rotary.to(DEVICE).kernel_args(
                positions.to(DEVICE), *[n and n.to(DEVICE) for n in norms]
            )
        }
        if rope
        else {}
    )
    new_kv = (new_k.to(DEVICE), new_v.to(DEVICE), slots.to(DEVICE))
    counters = tri.SplitCounters()
    for _ in range(2):  # twice: the second launch finds the counters at zero again
        out = tri.paged_decode_attention(
            q.to(DEVICE),
            *_decode_args(case)[1:],
            0.3,
            num_splits=num_splits,
            BLOCK_N=16,
            new_kv=new_kv,
            counters=counters,
            **extra,
        )
        torch.testing.assert_close(case["k_cache"], k_full, equal_nan=True, atol=1e-6, rtol=1e-6)
        assert torch.equal(case["v_cache"].nan_to_num(), v_full.nan_to_num())
        nonempty = case["context_lens"] > 0
        torch.testing.assert_close(out[nonempty], expected[nonempty], atol=1e-3, rtol=1e-3)
        assert torch.equal(out[~nonempty], torch.zeros_like(out[~nonempty]))
    if rope:  # the rotation mattered
        assert not torch.allclose(q_rot.float(), q.float(), atol=0.05)
    if num_splits > 1:
        assert not counters.get(out.device, 1).any()


@pytest.mark.parametrize("num_splits", [None, 1, 2, 8])
def test_decode_default_tiles_and_splits(mods, num_splits):
    tri, ref = mods
    case = _decode_case(16, 8, 2, 24, seed=5, ctxs=[130, 64, 1, 200])  # group of 4
    expected = ref.paged_attention(*_prefill_args(case), 0.2)
    out = tri.paged_decode_attention(*_decode_args(case), 0.2, num_splits=num_splits)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_context_gives_zeros(mods, num_splits):
    """A padding row (context_len 0, e.g. in a CUDA-graph batch) yields zeros, not NaN."""
    tri, ref = mods
    case = _decode_case(4, 4, 2, 16, ctxs=[6, 9])
    context_lens = case["context_lens"].clone()
    context_lens[0] = 0
    out = tri.paged_decode_attention(
        case["q"],
        case["k_cache"],
        case["v_cache"],
        context_lens,
        case["block_tables"],
        0.3,
        num_splits=num_splits,
        BLOCK_N=16,
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = ref.paged_attention(*_prefill_args(case), 0.3)
    torch.testing.assert_close(out[1], expected[1], atol=1e-4, rtol=1e-4)


def test_decode_fp16(mods):
    tri, ref = mods
    case = _decode_case(4, 4, 2, 16, dtype=torch.float16)
    expected = ref.paged_attention(*_prefill_args(case), 0.3)
    out = tri.paged_decode_attention(*_decode_args(case), 0.3, num_splits=2, BLOCK_N=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)


def test_store_then_attend_roundtrip(mods):
    """store_kvcache + prefill: a prefix chunk, then the rest of the prompt, then decode."""
    tri, ref = mods
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 3
    g = torch.Generator().manual_seed(7)
    total = 12
    q_all = torch.randn(total + 1, heads, head_dim, generator=g).to(DEVICE)
    k_all = torch.randn(total + 1, kv_heads, head_dim, generator=g).to(DEVICE)
    v_all = torch.randn(total + 1, kv_heads, head_dim, generator=g).to(DEVICE)
    k_cache = torch.zeros(8, block_size, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[6, 2, 7, 0, 5, -1]], dtype=torch.int32, device=DEVICE)

    def slots(lo, hi):
        return torch.tensor(
            [int(table[0, p // block_size]) * block_size + p % block_size for p in range(lo, hi)],
            dtype=torch.int64,
            device=DEVICE,
        )

    outs = []
    for lo, hi in [(0, 5), (5, total)]:  # chunked prefill: 5 tokens, then 7 more
        tri.store_kvcache(k_all[lo:hi], v_all[lo:hi], k_cache, v_cache, slots(lo, hi))
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        ctx = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        outs.append(
            tri.paged_prefill_attention(
                q_all[lo:hi], k_cache, v_cache, cu, ctx, table, 0.3, hi - lo, BLOCK_M=16, BLOCK_N=16
            )
        )
    tri.store_kvcache(k_all[total:], v_all[total:], k_cache, v_cache, slots(total, total + 1))
    ctx = torch.tensor([total + 1], dtype=torch.int32, device=DEVICE)
    outs.append(
        tri.paged_decode_attention(q_all[total:], k_cache, v_cache, ctx, table, 0.3, BLOCK_N=16)
    )
    got = torch.cat(outs)
    expected = dense_causal(q_all.cpu(), k_all.cpu(), v_all.cpu(), 0.3)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------
# GPU only: realistic shapes
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_realistic_shapes(mods, block_size, dtype):
    tri, ref = mods
    heads, kv_heads, head_dim = 16, 8, 128
    scale = head_dim**-0.5
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # prefill: full prompts, prompts after a cached prefix, and chunks of long prompts
    seqs = [(2048, 2048), (1000, 1000), (1500, 300), (777, 1), (2048, 512), (64, 64), (300, 17)]
    case = make_paged(seqs, block_size, heads, kv_heads, head_dim, dtype=dtype, poison=False)
    expected = ref.paged_attention(*_prefill_args(case), scale)
    out = tri.paged_prefill_attention(*_prefill_args(case), scale, max(q for _, q in seqs))
    torch.testing.assert_close(out, expected, **tol)
    # decode, with and without split-K
    case = _decode_case(
        block_size, heads, kv_heads, head_dim, ctxs=[2048, 1, 513, 1024, 77, 1999] * 4, dtype=dtype
    )
    expected = ref.paged_attention(*_prefill_args(case), scale)
    for num_splits in [None, 1, 4]:
        out = tri.paged_decode_attention(*_decode_args(case), scale, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **tol)
