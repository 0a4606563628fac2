"""Checks for speculative.ipynb: the acceptance rule of speculative sampling, the n-gram
proposal (prompt lookup), and handing back the KV slots of rejected tokens."""

import math

import torch

from nanovllm_final.engine.proposers import ngram_lookup

from .report import expect_equal, fail


def emitted_counts(fn, p: torch.Tensor, q: torch.Tensor, draws: int, seed: int) -> torch.Tensor:
    """How often each token comes out of fn(p, q, draft, u, noise) when the draft is drawn from q."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(p))
    drafts = torch.multinomial(q, draws, replacement=True, generator=g)
    uniforms = torch.rand(draws, generator=g)
    noise = torch.empty(draws, len(p)).exponential_(generator=g)
    for d, u, e in zip(drafts.tolist(), uniforms.tolist(), noise):
        counts[int(fn(p, q, d, u, e))] += 1
    return counts


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of counts against p, and its critical value at alpha = 5e-4 (Wilson-Hilferty)."""
    expected = p * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(p) - 1
    return stat, df * (1 - 2 / (9 * df) + 3.29 * math.sqrt(2 / (9 * df))) ** 3


def check_accept_or_resample(accept_or_resample) -> str:
    """accept_or_resample(p, q, draft, u, noise) -> the token a verify row emits: `draft` (drawn
    from q) if u < min(1, p[draft] / q[draft]), else argmax((p - q)+ / noise), a draw from the
    normalised residual by Gumbel-max (noise: Exp(1) per token). Checked token by token on
    chosen cases, then in distribution: 4000 draws must follow p."""
    p = torch.tensor([0.40, 0.05, 0.25, 0.10, 0.20])
    q = torch.tensor([0.10, 0.40, 0.20, 0.10, 0.20])
    noise = torch.tensor([1.0, 1.0, 0.5, 2.0, 1.0])
    cases = [(0, 0.99, 0), (2, 0.5, 2), (1, 0.01, 1), (1, 0.2, 0), (4, 0.999, 4), (3, 0.9, 3)]
    for draft, u, expected in cases:  # draft 1: p/q = 1/8; the residual (p - q)+ is [0.3, 0, 0.05, 0, 0]
        got = accept_or_resample(p, q, draft, u, noise)
        expect_equal(
            int(got),
            expected,
            "the wrong token for this row (accept if u < min(1, p[d]/q[d]), "
            "else argmax((p - q).clamp(min=0) / noise))",
            draft=draft,
            u=u,
            p_over_q=round(float(p[draft] / q[draft]), 3),
        )
    counts = emitted_counts(accept_or_resample, p, q, 4000, seed=5)
    stat, critical = chi_square(counts, p)
    if stat > critical:
        fail(
            "the tokens it emits do not follow p (chi-square test)",
            p=p.tolist(),
            emitted_shares=(counts / counts.sum()).tolist(),
            chi_square=round(stat, 1),
            critical_value=round(critical, 1),
        )
    return (f"the expected token in {len(cases)} cases, and 4000 draws that follow p "
            f"(chi-square {stat:.1f} < {critical:.1f})")


def check_ngram_propose(ngram_propose) -> str:
    """ngram_propose(token_ids, k, min_n, max_n) -> up to k tokens: those that followed the last
    earlier occurrence of the sequence's last n tokens, the longest n in [min_n, max_n] that
    recurs; [] if none does. Compared with the engine's ngram_lookup."""
    cases = [
        ([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2], 3, 1, 3),
        ([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2], 2, 3, 3),
        ([4, 4, 4, 4], 3, 1, 2),
        ([1, 2, 3], 2, 1, 2),
        ([7, 1, 2, 7, 3, 9, 1, 2, 7], 2, 1, 3),
        ([1, 2, 1, 3, 1, 2, 1], 4, 2, 3),
        ([3, 8], 2, 1, 1),
        ([1, 2, 9, 5, 2, 8, 1, 2], 2, 1, 2),
    ]
    for ids, k, low, high in cases:
        expected = ngram_lookup(torch.tensor(ids).numpy(), k, low, high)
        expect_equal(
            list(ngram_propose(list(ids), k, low, high)),
            expected,
            "another proposal than prompt lookup's",
            token_ids=ids,
            k=k,
            min_n=low,
            max_n=high,
        )
    return f"the engine's proposals in {len(cases)} cases (longest suffix first, its last earlier occurrence)"


def check_rollback(rollback) -> str:
    """STRETCH. rollback(block_table, ref_counts, free_blocks, num_tokens, block_size) after a verify
    step: the sequence keeps `num_tokens` tokens; the blocks of its table past those that hold them
    are handed back (ref_counts[b] -= 1; a block whose count reaches 0 is appended to free_blocks),
    and cut from the table (in place). Returns how many slots of its last block hold rejected K/V
    that the next step overwrites (0 if that block is full of kept tokens)."""
    cases = [
        ([3, 7, 9], {3: 1, 7: 1, 9: 1}, 5, 4),
        ([3, 7, 9], {3: 1, 7: 1, 9: 1}, 8, 4),
        ([2, 5], {2: 2, 5: 1}, 3, 4),
        ([4, 6, 1, 8], {4: 1, 6: 1, 1: 2, 8: 1}, 6, 4),
        ([0], {0: 1}, 2, 16),
    ]
    for table, counts, num_tokens, block_size in cases:
        mine_table, mine_counts, mine_free = list(table), dict(counts), [11]
        ref_table, ref_counts, ref_free = list(table), dict(counts), [11]
        got = rollback(mine_table, mine_counts, mine_free, num_tokens, block_size)
        keep = -(-num_tokens // block_size)
        for b in ref_table[keep:]:
            ref_counts[b] -= 1
            if ref_counts[b] == 0:
                ref_free.append(b)
        del ref_table[keep:]
        inputs = dict(block_table=table, ref_counts=counts, num_tokens=num_tokens, block_size=block_size)
        expect_equal(mine_table, ref_table, "the block table after the rollback", **inputs)
        expect_equal(mine_counts, ref_counts, "the reference counts after the rollback", **inputs)
        expect_equal(
            mine_free, ref_free, "the free list after the rollback (a shared block stays taken)", **inputs
        )
        expect_equal(
            got, (block_size - num_tokens % block_size) % block_size, "the slots left to overwrite", **inputs
        )
    return f"the same tables, counts, free lists and slots in {len(cases)} cases (a shared block among them)"
