"""Checks for kernels.ipynb: merging the partial softmaxes of a split context (the reduction of
split-K decoding), and the KV-store kernel written in Triton (run under TRITON_INTERPRET=1 on a CPU:
set it before anything imports triton)."""

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
