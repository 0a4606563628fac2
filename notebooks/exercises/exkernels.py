"""Checks for kernels.ipynb: merging the partial softmaxes of a split context (the reduction of
split-K decoding), the key ranges a tile of the paged prefill kernel reads, what an fp8 KV cache
stores (read back by the engine's Triton decode kernel), and the KV-store kernel written in Triton
(all run under TRITON_INTERPRET=1 on a CPU: set it before anything imports triton)."""

import importlib
import math

import torch

from . import stage
from .report import expect_close, fail

STAGE = "03_paged"


def split_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int):
    """Split-K, readable: cut the context (keys and values, (n, heads, d)) into num_splits pieces
    of ceil(n / num_splits) keys; for each piece, the attention output of the single query
    q (heads, d) over that piece alone, and the log-sum-exp of its scores (natural log). A
    piece past the end of the context saw no key: its lse is -inf, and its output is whatever
    the memory held (here: garbage)."""
    n, heads, d = k.shape
    size = -(-n // num_splits)
    outs, lses = [], []
    for s in range(num_splits):
        keys, values = k[s * size : (s + 1) * size], v[s * size : (s + 1) * size]  # (piece, heads, d)
        if len(keys) == 0:
            outs.append(torch.full((heads, d), 123.0))  # an empty piece: nothing written, garbage left
            lses.append(torch.full((heads,), -math.inf))
            continue
        scores = torch.einsum("hd,nhd->hn", q, keys) / math.sqrt(d)  # (heads, piece)
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), values))  # (heads, d), normalised in the piece
        lses.append(scores.logsumexp(-1))  # (heads,)
    return torch.stack(outs), torch.stack(lses)  # (splits, heads, d), (splits, heads)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The single query's attention over the whole context, in one softmax: (heads, d)."""
    scores = torch.einsum("hd,nhd->hn", q, k) / math.sqrt(q.shape[-1])  # (heads, n)
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


def check_merge_splits(merge_splits) -> str:
    """merge_splits(part_out, part_lse) -> (heads, d): the attention over the whole context, from
    the pieces' normalised outputs (splits, heads, d) and log-sum-exps (splits, heads). Compared
    with one softmax over the whole context."""
    g = torch.Generator().manual_seed(17)
    cases = [(40, 4, 2, 8), (17, 3, 4, 8), (5, 8, 2, 4), (64, 1, 1, 16), (9, 2, 3, 8)]  # (n, splits, heads, d)
    for n, splits, heads, d in cases:
        q = torch.randn(heads, d, generator=g) * 2
        k, v = torch.randn(n, heads, d, generator=g), torch.randn(n, heads, d, generator=g)
        k[n // 2] += 3 * q / q.norm(dim=-1, keepdim=True)  # one key that stands out: its piece must weigh most
        part_out, part_lse = split_partials(q, k, v, splits)
        got = merge_splits(part_out.clone(), part_lse.clone())
        empty = int(torch.isinf(part_lse[:, 0]).sum())
        expect_close(got, attention(q, k, v), "the merged output differs from one softmax over the whole context "
                     "(weigh each piece by exp(lse) over the sum of exp(lse), subtracting the largest lse first; "
                     "a piece with lse = -inf weighs nothing)", atol=1e-5, context=n, splits=splits, empty_pieces=empty)
    return f"the same output as one softmax over the whole context in {len(cases)} cases (pieces past the end included)"


def check_store_kvcache(store_kvcache) -> str:
    """STRETCH. store_kvcache(key, value, k_cache, v_cache, slot_mapping): write token t's key and
    value (N, kv_heads, head_dim) into slot slot_mapping[t] of the caches (num_blocks, block_size,
    kv_heads, head_dim), in place, skipping slot -1; with a Triton kernel of your own, one program
    per token. Compared with the stage's torch store_kvcache on the same inputs, keys that are
    views into a fused qkv tensor (strided) included."""
    reference = stage.module(STAGE, "layers.attention_torch").store_kvcache
    g = torch.Generator().manual_seed(18)
    cases = [(5, 2, 4, 8, 3), (7, 1, 8, 4, 6), (4, 4, 16, 2, 5), (6, 2, 6, 3, 8)]  # (tokens, kv_heads, d, block, blocks)
    for tokens, kv_heads, d, block_size, num_blocks in cases:
        qkv = torch.randn(tokens, 3 * kv_heads * d, generator=g)  # keys and values as views of one fused tensor
        key = qkv[:, kv_heads * d : 2 * kv_heads * d].view(tokens, kv_heads, d)  # (tokens, kv_heads, d), strided
        value = qkv[:, 2 * kv_heads * d :].view(tokens, kv_heads, d)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
        slots[1] = -1  # a padding token: store nothing
        caches = [torch.randn(num_blocks, block_size, kv_heads, d, generator=g) for _ in range(2)]
        expected = [c.clone() for c in caches]
        reference(key, value, *expected, slots)
        got = [c.clone() for c in caches]
        result = store_kvcache(key, value, *got, slots.clone())
        if result is not None and not isinstance(result, tuple):
            fail("write into k_cache and v_cache in place; return nothing")
        for name, mine, theirs in zip(("k_cache", "v_cache"), got, expected):
            expect_close(mine, theirs, f"{name} differs from the stage's store_kvcache (slot s is block s // block_size, "
                         "offset s % block_size; slot -1 stores nothing; read key and value through their strides)",
                         atol=0.0, tokens=tokens, kv_heads=kv_heads, head_dim=d, block_size=block_size,
                         key_strides=key.stride())
    return f"the same caches as the stage's store_kvcache in {len(cases)} cases (strided keys, a skipped slot)"


# ---- the paged prefill kernel: which keys a tile of queries reads, with and without the mask ----


def check_prefill_key_tiles(prefill_key_tiles) -> str:
    """prefill_key_tiles(q_len, context_len, tile_m, BLOCK_M, BLOCK_N) -> (full_end, kv_end): the
    keys that query tile tile_m of one sequence (queries tile_m * BLOCK_M .. + BLOCK_M of its q_len
    new tokens, which come after context_len - q_len cached ones) reads without a mask, [0, full_end),
    and with the causal mask, [full_end, kv_end). Checked against what the causal mask allows: no key
    read unmasked may lie after any query of the tile, the unmasked part is whole key tiles and as long
    as it can be, and [0, kv_end) holds every key some query of the tile sees and nothing past them."""
    cases = [(10, 10, 16, 16), (10, 30, 16, 16), (40, 40, 16, 16), (40, 100, 16, 8), (33, 97, 8, 16),
             (64, 64, 64, 64), (5, 77, 16, 16), (70, 70, 16, 32)]  # (q_len, context_len, BLOCK_M, BLOCK_N)
    tiles = 0
    for q_len, context_len, block_m, block_n in cases:
        prefix = context_len - q_len
        for tile_m in range(-(-q_len // block_m)):
            got = prefill_key_tiles(q_len, context_len, tile_m, block_m, block_n)
            if not (isinstance(got, tuple) and len(got) == 2):
                fail("return a pair (full_end, kv_end)", got=got)
            full_end, kv_end = (int(x) for x in got)
            first_q = prefix + tile_m * block_m  # position of the tile's first query
            last_q = min(prefix + (tile_m + 1) * block_m, context_len) - 1  # and of its last real one
            where = dict(q_len=q_len, context_len=context_len, cached_prefix=prefix, tile_m=tile_m, BLOCK_M=block_m,
                         BLOCK_N=block_n, first_query_position=first_q, last_query_position=last_q,
                         full_end=full_end, kv_end=kv_end)
            if full_end % block_n:
                fail("full_end must end a whole key tile (a multiple of BLOCK_N): the unmasked loop reads whole tiles",
                     **where)
            if full_end > first_q + 1:
                fail("keys before full_end are read without the mask, but some lie after the tile's first query "
                     "(position prefix + tile_m * BLOCK_M): it would see its future", **where)
            if full_end + block_n <= first_q:
                fail("full_end stops a whole key tile early: that tile is visible to every query of the tile and "
                     "could be read without the mask (round the first query's position down to whole tiles)",
                     **where)
            if kv_end <= last_q:
                fail("kv_end stops before the last query's own position: keys it must see are never read", **where)
            if kv_end > last_q + 1:
                fail("kv_end reads keys after the tile's last query: no query of the tile sees them (tiles above "
                     "the diagonal are never visited)", **where)
            tiles += 1
    return f"the right key ranges for {tiles} query tiles of {len(cases)} sequences (cached prefixes included)"


# ---- the fp8 KV cache: quantize on store, dequantize in registers ----


def check_quantize_kv(quantize_kv) -> str:
    """quantize_kv(x, scale) -> what an fp8 cache stores of x (..., kv_heads, head_dim): x divided by
    its kv head's scale (scale: (kv_heads,) float32), saturated at +-448 (e4m3's largest value), as
    torch.float8_e4m3fn. Compared with the engine's own quantize, then read back by the engine's Triton
    paged decode kernel (dequantizing in registers) and compared with attention over the values you
    stored, dequantized."""
    attention_torch = importlib.import_module("nanovllm_final.layers.attention_torch")
    attention_triton = importlib.import_module("nanovllm_final.kernels.attention")
    g = torch.Generator().manual_seed(19)
    cases = [(2, 16, [0.5, 2.0]), (4, 8, [1.0, 0.01, 3.0, 0.25]), (1, 32, [1.0])]  # (kv_heads, d, scales)
    for kv_heads, d, scales in cases:
        scale = torch.tensor(scales, dtype=torch.float32)
        x = torch.randn(12, kv_heads, d, generator=g) * 4
        x[3, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -3e3])  # beyond 448 * scale: must saturate, never inf or nan
        got = quantize_kv(x.clone(), scale.clone())
        if not isinstance(got, torch.Tensor) or got.dtype != attention_torch.FP8 or got.shape != x.shape:
            fail("return a torch.float8_e4m3fn tensor of x's shape", got=getattr(got, "dtype", type(got)),
                 shape=getattr(got, "shape", None), expected=(attention_torch.FP8, tuple(x.shape)))
        if torch.isnan(got.float()).any():
            fail("some stored values are NaN: e4m3fn has no infinity (saturate first: clamp to +-448)",
                 kv_heads=kv_heads, scales=scales)
        expected = attention_torch.quantize(x, scale)
        expect_close(got.float(), expected.float(), "the stored values differ from the engine's quantize (divide each "
                     "kv head's values by its scale, in float32, clamp to +-448, cast)", atol=0.0, kv_heads=kv_heads,
                     scales=scales)
        _read_back(attention_torch, attention_triton, got, scale, g)
    return (f"the engine's stored values in {len(cases)} cases (saturation included), read back by its Triton decode "
            "kernel to the same attention")


def _read_back(attention_torch, attention_triton, stored, scale, g) -> None:
    """Attention of one query over `stored` (12 tokens in blocks of 4) by the engine's Triton kernel
    with an fp8 cache, against the same attention over the dequantized values in float32."""
    n, kv_heads, d = stored.shape
    q = torch.randn(1, 2 * kv_heads, d, generator=g)  # (1 sequence, heads, d): two query heads per kv head
    cache = stored.contiguous().view(3, 4, kv_heads, d)  # (blocks, block_size, kv_heads, d): K and V alike
    table = torch.tensor([[2, 0, 1]], dtype=torch.int32)  # the sequence reads block 2 first, then 0, then 1
    lens = torch.tensor([n], dtype=torch.int32)
    got = attention_triton.paged_decode_attention(q, cache, cache, lens, table, d**-0.5, k_scale=scale, v_scale=scale)
    kv = attention_torch.dequantize(cache[table[0].long()].reshape(n, kv_heads, d), scale, torch.float32)
    kv = kv.repeat_interleave(2, dim=1)  # (n, heads, d): each kv head serves its two query heads
    expected = torch.einsum("hn,nhd->hd", (torch.einsum("hd,nhd->hn", q[0], kv) * d**-0.5).softmax(-1), kv)
    expect_close(got[0], expected, "the Triton kernel, reading your stored values with the scales, disagrees with "
                 "attention over them dequantized", atol=1e-4 * float(kv.abs().max()), scales=scale.tolist())
