"""The flash_attn backend (layers/attention_flash.py) on CPU, through a stand-in for flash-attn.

No flash-attn wheel exists on the machines here, so the real package has never run this
backend. tests/flash_attn_standin/flash_attn/ implements, in plain PyTorch, the documented
semantics of the two functions the backend calls (flash_attn_varlen_func with a block_table,
flash_attn_with_kvcache); it is first checked against dense attention written here, then put
on sys.path as `flash_attn` so each engine's attention_flash.py can be compared with that
engine's PyTorch reference (layers/attention_torch.py). Like the real package, the stand-in
accepts only fp16/bf16, so these tests run in both.
"""

import hashlib
import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from common import ENGINES, ROOT, engine_module

STANDIN = Path(__file__).parent / "flash_attn_standin"
BLOCK = 256  # flash-attn's paged kernels need page_block_size % 256 == 0
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32  # GQA: two query heads per kv head
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
DTYPES = list(TOL)
SCALE = 0.1  # not the default 1/sqrt(head_dim), so a wrapper that drops softmax_scale fails


def _engine_dir(name: str) -> Path:
    return ROOT / "nanovllm_final" if name == "final" else ROOT / "stages" / name


def _flash_engines() -> list[str]:
    """Every engine with layers/attention_flash.py; engines whose attention files are
    byte-identical to an earlier one's are tested once, under the first."""
    seen, picked = set(), []
    for name in ENGINES:
        layers = _engine_dir(name) / "layers"
        if not (layers / "attention_flash.py").exists():
            continue
        key = tuple(
            hashlib.sha1((layers / f).read_bytes()).hexdigest()
            for f in ("attention.py", "attention_flash.py", "attention_torch.py")
        )
        if key not in seen:
            seen.add(key)
            picked.append(name)
    return picked


FLASH_ENGINES = _flash_engines()


def _is_flash_module(name: str) -> bool:
    return (
        name == "flash_attn"
        or name.startswith("flash_attn.")
        or name.endswith(".layers.attention_flash")
    )


def _forget_flash_modules() -> None:
    for name in [n for n in sys.modules if _is_flash_module(n)]:
        del sys.modules[name]
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], child):
            delattr(
                sys.modules[parent], child
            )  # else `from . import attention_flash` would find the old one


@pytest.fixture
def flash_attn(monkeypatch):
    """The stand-in, importable as `flash_attn` during one test. Modules that imported it
    (the engines' attention_flash) are forgotten afterwards, and whatever was there before
    is put back."""
    before = {n: m for n, m in sys.modules.items() if _is_flash_module(n)}
    _forget_flash_modules()
    monkeypatch.syspath_prepend(str(STANDIN))
    module = importlib.import_module("flash_attn")
    assert Path(module.__file__).is_relative_to(STANDIN)
    yield module
    _forget_flash_modules()
    for name, module in before.items():
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


# --------------------------------------------------------------------------------------
# A batch on a paged cache
# --------------------------------------------------------------------------------------


def make_batch(seqs, dtype, seed=0, poison=True):
    """seqs: (context_len, q_len) per sequence; the queries are the last q_len positions.

    Returns per-sequence contiguous K/V (ks, vs: (context_len, kv_heads, head_dim)), the
    packed queries q (tokens, heads, head_dim) scaled so attention is peaked (every key
    matters), an empty paged cache with spare blocks and NaN in every slot (poison=True),
    shuffled block tables padded with -1, and the int32 metadata the engines use."""
    g = torch.Generator().manual_seed(seed)
    blocks = [(c + BLOCK - 1) // BLOCK for c, _ in seqs]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full(
        (len(seqs), max(max(blocks), 1) + 1), -1, dtype=torch.int32
    )  # (seqs, max_blocks)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    fill = float("nan") if poison else 0.0
    k_cache = torch.full(
        (num_blocks, BLOCK, KV_HEADS, HEAD_DIM), fill, dtype=dtype
    )  # (blocks, block, kv_heads, dim)
    v_cache = torch.full_like(k_cache, fill)
    ks = [torch.randn(c, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for c, _ in seqs]
    vs = [torch.randn(c, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for c, _ in seqs]
    qs = [(3 * torch.randn(n, HEADS, HEAD_DIM, generator=g)).to(dtype) for _, n in seqs]
    return dict(
        ks=ks,
        vs=vs,
        qs=qs,
        q=torch.cat(qs),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=tables,
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        cu_seqlens_q=F.pad(torch.tensor([n for _, n in seqs]).cumsum(0), (1, 0)).to(torch.int32),
        max_seqlen_q=max(n for _, n in seqs),
    )


def slots(table_row, positions):
    """Cache slots of token positions of one sequence: block * BLOCK + offset. (n,) int64"""
    return table_row.long()[positions // BLOCK] * BLOCK + positions % BLOCK


def dense_causal(q, k, v, scale):
    """Attention of the last len(q) tokens of a sequence over all its len(k) keys, computed
    directly (SDPA with an explicit mask by absolute position, GQA by repeating kv heads).
    q: (q_len, heads, dim), k/v: (ctx, kv_heads, dim) -> (q_len, heads, dim) float32"""
    q_len, ctx = q.shape[0], k.shape[0]
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]  # absolute positions of the queries
    mask = torch.arange(ctx)[None, :] <= q_pos  # (q_len, ctx)
    rep = q.shape[1] // k.shape[1]
    k, v = (
        t.float().repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v)
    )  # (heads, ctx, dim)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)  # (q_len, heads, dim)


# --------------------------------------------------------------------------------------
# The stand-in itself
# --------------------------------------------------------------------------------------


def test_standin_causal_mask_is_the_documented_bottom_right_one(flash_attn):
    """The two masks drawn in flash-attn's docstrings. With q = 0 every visible key gets the
    same weight and v[j] = e_j, so output[i, :, j] > 0 exactly where query i sees key j."""
    documented = {
        (2, 5): [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
        (5, 2): [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]],  # rows that see nothing output 0
    }
    for (sq, sk), mask in documented.items():
        q = torch.zeros(sq, HEADS, HEAD_DIM, dtype=torch.float16)
        v = torch.zeros(sk, KV_HEADS, HEAD_DIM, dtype=torch.float16)
        v[torch.arange(sk), :, torch.arange(sk)] = 1.0
        k = torch.randn(sk, KV_HEADS, HEAD_DIM).half()
        cu_q, cu_k = (
            torch.tensor([0, sq], dtype=torch.int32),
            torch.tensor([0, sk], dtype=torch.int32),
        )
        varlen = flash_attn.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, sq, sk, causal=True
        )  # (sq, heads, dim)
        kvcache = flash_attn.flash_attn_with_kvcache(
            q[None], k[None], v[None], cache_seqlens=sk, causal=True
        )[0]
        for out in (varlen, kvcache):
            assert ((out[:, :, :sk] > 0).int() == torch.tensor(mask)[:, None, :]).all()
            assert (out[:, :, sk:] == 0).all()
        full = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, sk, causal=False)
        assert (full[:, :, :sk] > 0).all()  # causal=False: every query sees every key


@pytest.mark.parametrize("dtype", DTYPES)
def test_standin_matches_dense_attention(flash_attn, dtype):
    """Paged and contiguous varlen, and the kvcache call, against dense attention: several
    sequences, GQA, queries after a cached prefix (bottom-right alignment), one query, a
    context spanning several 256-token pages with a partial last page."""
    seqs = [(300, 300), (700, 45), (513, 1), (256, 256)]
    b = make_batch(seqs, dtype)
    for i, (ctx, _) in enumerate(seqs):
        pos = slots(b["block_tables"][i], torch.arange(ctx))
        b["k_cache"].view(-1, KV_HEADS, HEAD_DIM)[pos] = b["ks"][i]
        b["v_cache"].view(-1, KV_HEADS, HEAD_DIM)[pos] = b["vs"][i]
    scale = 0.2
    want = torch.cat([dense_causal(q, k, v, scale) for q, k, v in zip(b["qs"], b["ks"], b["vs"])])
    cu_k = F.pad(b["context_lens"].cumsum(0), (1, 0)).to(torch.int32)
    max_k = int(b["context_lens"].max())
    paged = flash_attn.flash_attn_varlen_func(
        b["q"],
        b["k_cache"],
        b["v_cache"],
        b["cu_seqlens_q"],
        cu_k,
        b["max_seqlen_q"],
        max_k,
        softmax_scale=scale,
        causal=True,
        block_table=b["block_tables"],
    )
    packed = flash_attn.flash_attn_varlen_func(
        b["q"],
        torch.cat(b["ks"]),
        torch.cat(b["vs"]),
        b["cu_seqlens_q"],
        cu_k,
        b["max_seqlen_q"],
        max_k,
        softmax_scale=scale,
        causal=True,
    )
    for out in (paged, packed):
        assert out.shape == b["q"].shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), want, **TOL[dtype])
    # kvcache: the last 3 tokens of every sequence as (batch, 3, heads, dim) queries
    q3 = torch.stack([q[-1:].expand(3, -1, -1) if len(q) < 3 else q[-3:] for q in b["qs"]])
    lens = b["context_lens"].clone()
    out = flash_attn.flash_attn_with_kvcache(
        q3,
        b["k_cache"],
        b["v_cache"],
        cache_seqlens=lens,
        block_table=b["block_tables"],
        softmax_scale=scale,
        causal=True,
    )  # (batch, 3, heads, dim)
    for i in range(len(seqs)):
        torch.testing.assert_close(
            out[i].float(), dense_causal(q3[i], b["ks"][i], b["vs"][i], scale), **TOL[dtype]
        )


def test_standin_refuses_what_it_does_not_implement_or_flash_attn_refuses(flash_attn):
    b = make_batch([(300, 300)], torch.float16, poison=False)
    cu = torch.tensor([0, 300], dtype=torch.int32)
    args = (b["q"], b["k_cache"], b["v_cache"], cu, cu, 300, 300)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn.flash_attn_varlen_func(*args, dropout_p=0.1, block_table=b["block_tables"])
    with pytest.raises(NotImplementedError, match="window_size"):
        flash_attn.flash_attn_varlen_func(*args, window_size=(8, 0), block_table=b["block_tables"])
    with pytest.raises(NotImplementedError, match="k="):
        flash_attn.flash_attn_with_kvcache(
            b["q"][:1, None],
            b["k_cache"],
            b["v_cache"],
            k=b["ks"][0][:1, None],
            v=b["vs"][0][:1, None],
            block_table=b["block_tables"],
        )
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        flash_attn.flash_attn_varlen_func(
            args[0].float(),
            *(a.float() for a in args[1:3]),
            *args[3:],
            block_table=b["block_tables"],
        )
    with pytest.raises(RuntimeError, match="int32"):
        flash_attn.flash_attn_varlen_func(*args, block_table=b["block_tables"].long())
    small = b["k_cache"].view(-1, 16, KV_HEADS, HEAD_DIM)  # 16-token pages
    with pytest.raises(RuntimeError, match="divisible by 256"):
        flash_attn.flash_attn_varlen_func(
            args[0], small, small, *args[3:], block_table=b["block_tables"]
        )
    with pytest.raises(RuntimeError, match="outside the cache"):  # a -1 pad inside the context
        flash_attn.flash_attn_varlen_func(
            args[0],
            *args[1:4],
            torch.tensor([0, 300], dtype=torch.int32),
            300,
            300,
            block_table=b["block_tables"][:, 1:].contiguous(),
        )


# --------------------------------------------------------------------------------------
# Each engine's attention_flash.py against its PyTorch reference
# --------------------------------------------------------------------------------------


def _store(torch_ref, b, seqs):
    """Write every context token's K/V with the torch backend's store: first the cached
    prefix (earlier steps), then this step's tokens, as the engines do."""
    for i, (ctx, q_len) in enumerate(seqs):
        for part in (torch.arange(ctx - q_len), torch.arange(ctx - q_len, ctx)):
            torch_ref.store_kvcache(
                b["ks"][i][part],
                b["vs"][i][part],
                b["k_cache"],
                b["v_cache"],
                slots(b["block_tables"][i], part).to(torch.int32),
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("engine", FLASH_ENGINES)
def test_paged_prefill_matches_torch_reference(flash_attn, engine, dtype):
    flash = engine_module(engine, "layers.attention_flash")
    torch_ref = engine_module(engine, "layers.attention_torch")
    assert flash.flash_attn_varlen_func is flash_attn.flash_attn_varlen_func
    # plain prefill, chunks after a cached prefix (one ending mid-page, one at a page edge), one query
    seqs = [(300, 300), (700, 188), (512, 256), (257, 1)]
    b = make_batch(seqs, dtype, seed=1)
    _store(torch_ref, b, seqs)
    args = (
        b["q"],
        b["k_cache"],
        b["v_cache"],
        b["cu_seqlens_q"],
        b["context_lens"],
        b["block_tables"],
        SCALE,
    )
    got = flash.paged_prefill_attention(*args, b["max_seqlen_q"])  # (tokens, heads, dim)
    want = torch_ref.paged_attention(*args)
    assert got.shape == want.shape == b["q"].shape and got.dtype == dtype
    assert torch.isfinite(got).all() and got.abs().amax() > 0.1
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("engine", FLASH_ENGINES)
def test_paged_decode_matches_torch_reference(flash_attn, engine, dtype):
    flash = engine_module(engine, "layers.attention_flash")
    torch_ref = engine_module(engine, "layers.attention_torch")
    assert flash.flash_attn_with_kvcache is flash_attn.flash_attn_with_kvcache
    # one query per sequence; the last is a CUDA-graph padding row (empty context, no blocks)
    seqs = [(300, 1), (513, 1), (256, 1), (1, 1), (0, 1)]
    b = make_batch(seqs, dtype, seed=2)
    _store(torch_ref, b, seqs[:-1])
    b["qs"][-1].zero_()
    one_each = torch.arange(len(seqs) + 1, dtype=torch.int32)
    got = flash.paged_decode_attention(
        b["q"], b["k_cache"], b["v_cache"], b["context_lens"], b["block_tables"], SCALE
    )
    want = torch_ref.paged_attention(
        b["q"], b["k_cache"], b["v_cache"], one_each, b["context_lens"], b["block_tables"], SCALE
    )
    assert got.shape == want.shape == b["q"].shape and got.dtype == dtype
    assert torch.isfinite(got).all() and (got[-1] == 0).all()
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_final_flash_backend_gives_the_torch_backends_results(flash_attn):
    """The final engine's flash_attn backend (the module make_backend hands the runner) gives the torch backend's results."""
    attn = engine_module("final", "layers.attention")
    flash_backend = attn.make_backend(
        "flash_attn", torch.device("cuda"), BLOCK, torch.bfloat16
    )  # a name check: nothing runs on CUDA
    torch_backend = attn.make_backend("torch", torch.device("cpu"), BLOCK, torch.bfloat16)
    seqs = [(400, 144), (256, 256)]
    b = make_batch(seqs, torch.bfloat16, seed=3)
    _store(torch_backend, b, seqs)
    cache = (b["k_cache"], b["v_cache"])
    prefill = (
        b["q"],
        *cache,
        b["cu_seqlens_q"],
        b["context_lens"],
        b["block_tables"],
        0.125,
        b["max_seqlen_q"],
    )
    decode = (
        torch.stack([qs[-1] for qs in b["qs"]]),
        *cache,
        b["context_lens"],
        b["block_tables"],
        0.125,
    )
    torch.testing.assert_close(
        flash_backend.paged_prefill_attention(*prefill),
        torch_backend.paged_prefill_attention(*prefill),
        **TOL[torch.bfloat16],
    )
    torch.testing.assert_close(
        flash_backend.paged_decode_attention(*decode),
        torch_backend.paged_decode_attention(*decode),
        **TOL[torch.bfloat16],
    )


# --------------------------------------------------------------------------------------
# Backend selection: flash_attn needs CUDA, the package and block size % 256
# --------------------------------------------------------------------------------------


def _pick(
    engine: str, name: str, device: str, block_size: int, dtype: torch.dtype = torch.bfloat16
) -> str:
    """The backend an engine picks (stages: resolve_backend's name; final: make_backend's class's name).
    A "cuda" device is only a torch.device here: selection reads its type and nothing runs on it."""
    attn = engine_module(engine, "layers.attention")
    if hasattr(attn, "make_backend"):
        return attn.make_backend(name, torch.device(device), block_size, dtype).name
    return attn.resolve_backend(name, torch.device(device), block_size, dtype)


@pytest.mark.parametrize("engine", FLASH_ENGINES)
def test_backend_selection_with_flash_attn_installed(flash_attn, engine):
    assert _pick(engine, "auto", "cuda", 512) == "flash_attn"
    assert _pick(engine, "flash_attn", "cuda", 256) == "flash_attn"
    assert _pick(engine, "auto", "cuda", 16) == "triton"  # block size not a multiple of 256
    assert _pick(engine, "auto", "cpu", 256) == "torch"
    with pytest.raises(
        ValueError,
        match="needs CUDA, the flash-attn package, a kvcache_block_size that is a multiple of 256",
    ):
        _pick(engine, "flash_attn", "cpu", 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        _pick(engine, "flash_attn", "cuda", 16)
    # flash-attn computes in float16 / bfloat16 only: float32 is refused up front, and "auto" passes it by
    assert _pick(engine, "auto", "cuda", 512, torch.float32) == "triton"
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        _pick(engine, "flash_attn", "cuda", 256, torch.float32)


@pytest.mark.parametrize("engine", FLASH_ENGINES)
def test_backend_selection_without_flash_attn(monkeypatch, engine):
    monkeypatch.setitem(
        sys.modules, "flash_attn", None
    )  # importlib.util.find_spec("flash_attn") -> None
    assert _pick(engine, "auto", "cuda", 256) == "triton"
    with pytest.raises(ValueError, match="flash-attn package"):
        _pick(engine, "flash_attn", "cuda", 256)
