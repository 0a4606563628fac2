"""Proposers: where a verify step's k guesses come from.

NgramProposer (vLLM's prompt lookup, method "ngram"): the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min, the longest that matches wins) are looked up
earlier in the sequence, prompt and output alike; the tokens that followed their last
occurrence are the proposal. It costs a scan of the sequence's ids on the host, no model.
The draft-model proposer is draft_model.py's.

A proposer's `propose(seqs, ks)` returns up to ks[i] tokens for sequence i."""

import numpy as np

from .sequence import Sequence


def ngram_lookup(token_ids: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the last earlier occurrence of the longest suffix of
    `token_ids` (between min_n and max_n tokens long); [] if no suffix recurs. The earlier
    positions that end like the sequence are narrowed one token further back at a time, so a
    longer suffix is matched only where the shorter ones were."""
    length = len(token_ids)
    top = min(max_n, length - 1)  # the longest suffix with an earlier place to occur
    if top < min_n:
        return []
    # (matches,) positions before the last whose token is the last token: where an occurrence ends
    ends = np.flatnonzero(token_ids[: length - 1] == token_ids[length - 1])
    best = ends if min_n <= 1 else None  # the ends of the longest suffix (>= min_n) that recurs
    for j in range(1, top):  # the suffix of j + 1 tokens: its token j back matches too
        ends = ends[ends >= j]
        ends = ends[token_ids[ends - j] == token_ids[length - 1 - j]]
        if not len(ends):
            break
        if j + 1 >= min_n:
            best = ends
    if best is None or not len(best):
        return []
    first = int(best[-1]) + 1  # the token after the last occurrence
    return token_ids[first : first + k].tolist()


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] tokens for each sequence."""
        return [
            ngram_lookup(np.asarray(seq.token_ids, np.int64), k, self.min_n, self.max_n)
            for seq, k in zip(seqs, ks)
        ]


class ReplayProposer:
    """Benchmark and test use only (no engine option selects it): proposes the continuation a
    recorded run produced (`runs`: full token lists, prompt then output), each token replaced by
    a wrong one with probability 1 - `accept_rate`. With the target's own greedy outputs it
    controls the acceptance rate, which random weights would otherwise leave near 0."""

    def __init__(
        self, runs: list[list[int]], accept_rate: float = 1.0, vocab_size: int = 2, seed: int = 0
    ):
        self.runs, self.accept_rate, self.vocab_size = (
            [list(r) for r in runs],
            accept_rate,
            vocab_size,
        )
        self.rng = np.random.default_rng(seed)
        self.run_of: dict[int, list[int]] = {}  # seq_id -> its prompt's run, found once

    def _run(self, seq: Sequence) -> list[int]:
        """The run of the sequence's prompt (at any position, even past a divergence)."""
        run = self.run_of.get(seq.seq_id)
        if run is None:
            n, ids = seq.num_prompt_tokens, seq.token_ids
            run = next((r for r in self.runs if len(r) > n and r[:n] == ids[:n]), [])
            self.run_of[seq.seq_id] = run
        return run

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks):
            at = len(seq.token_ids)
            guess = self._run(seq)[at : at + k]
            if self.accept_rate >= 1.0:  # every proposal right: no draw
                out.append(guess)
                continue
            wrong = self.rng.random(len(guess)) >= self.accept_rate
            out.append(
                [
                    (t + 1 + int(self.rng.integers(self.vocab_size - 1))) % self.vocab_size
                    if w
                    else t
                    for t, w in zip(guess, wrong)
                ]
            )
        return out
