"""The draft-model proposer (method "draft_model"): a small model with the target's
vocabulary runs k cheap steps, each taking its argmax (a greedy draft: the rejection sampler's
q is a point mass, which keeps the target's distribution exact whatever the draft says).

The draft has its own paged KV cache, laid out like the target's (same block size and block
count), and uses the target's block tables: a token's draft K/V lives in the same slot as its
target K/V, so the blocks the scheduler hands out, frees and trims serve both caches. Each
sequence remembers how many of its tokens the draft has cached (`num_draft_cached`); a
proposal first feeds the draft what it has not seen (the whole prompt the first time, then the
tokens accepted since), then k - 1 single-token steps. The draft ignores prefix-cache hits: it
computes a sequence's prompt itself (a shared block gets the same draft K/V again). After a
verify step it keeps the K/V of the accepted proposals; a preempted sequence starts over.

It runs whole on rank 0's device, eager or from the draft runner's own decode CUDA graphs, also
under tensor parallelism: a draft is small (a few percent of the target), so split over the ranks
its k steps would each pay a collective per layer, more than their arithmetic; the other ranks
wait for the verify step in any case, and only rank 0 (which schedules and samples) needs the
proposals. Rank 0's device holds the draft's weights and cache on top of its shard."""

import dataclasses

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..distributed import get_tp_rank, get_tp_size, set_tp_rank
from .model_runner import ModelRunner
from .sequence import Sequence
from .step_input import StepInput, build_step_input


class _NoScoring:
    prompt_logprobs = None


class DraftView:
    """A sequence as the draft's step builder reads it: `token_ids`, of which the first `start`
    are in the draft's cache and the rest are fed; the target's block table."""

    params = _NoScoring()
    num_pending, spec_token_ids, index = 0, [], 0

    def __init__(self, seq: Sequence, token_ids: list[int], start: int):
        self.seq_id, self.block_table, self.token_ids = seq.seq_id, seq.block_table, token_ids
        self.num_prompt_tokens, self.num_prompt_scored = (
            seq.num_prompt_tokens,
            seq.num_prompt_tokens,
        )
        self.num_cached_tokens, self.num_scheduled_tokens = start, len(token_ids) - start
        self.num_known_tokens = len(token_ids)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, draft_dir: str, num_blocks: int):
        draft_config = dataclasses.replace(
            config,
            model=draft_dir,
            num_kvcache_blocks=num_blocks,
            tensor_parallel_size=1,
            speculative_config=None,
        )
        rank, size = get_tp_rank(), get_tp_size()  # the target's place in its tensor-parallel group
        self.runner = ModelRunner(
            draft_config, ModelConfig.from_dir(draft_dir), rank=0
        )  # whole, on this device
        set_tp_rank(rank, size)
        self.block_size = config.kvcache_block_size

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """ks[i] tokens for each sequence (whose slots the scheduler has given it). The first step
        feeds what the draft has not cached; the k - 1 after it are decode steps built at once,
        each fed the argmax of the one before on the device (carried): no read until the end."""
        if not seqs:
            return []
        views = [
            DraftView(seq, seq.token_ids, min(seq.num_draft_cached, len(seq.token_ids) - 1))
            for seq in seqs
        ]
        first = build_step_input(views, self.block_size)
        tokens = [self.runner.execute(first).argmax(dim=-1)]  # (live,) per step, on the device
        lives = [np.arange(len(seqs))]
        for step, live in decode_steps(first, np.asarray(ks), self.block_size):
            tokens.append(self.runner.execute(step, carried=tokens[-1]).argmax(dim=-1))
            lives.append(live)
        flat = iter(torch.cat(tokens).tolist())  # the only read of the proposals
        out: list[list[int]] = [[] for _ in seqs]
        for live in lives:
            for i in live.tolist():
                out[i].append(next(flat))
        return out

    def shutdown(self) -> None:
        self.runner.shutdown()


def decode_steps(first: StepInput, ks: np.ndarray, block_size: int):
    """(step, live) for the draft steps after `first`: step j (1..max(ks) - 1) feeds proposal j - 1
    of each sequence i with ks[i] > j (`live`, indices into the sequences), placed after the
    tokens `first` left in the cache; its id comes from the step before's row (carry_rows). The
    arrays of every step are computed at once; a step takes its row of them."""
    n, steps = len(ks), int(ks.max()) - 1
    positions = first.context_lens.astype(np.int64) + np.arange(steps)[:, None]  # (steps, seqs)
    # (steps, seqs); past a sequence's own steps the index is clipped (a row no step runs)
    within = np.minimum(positions.T // block_size, first.block_tables.shape[1] - 1)
    blocks = np.take_along_axis(first.block_tables, within, axis=1).T
    slots = blocks.astype(np.int64) * block_size + positions % block_size  # (steps, seqs)
    ends = (positions + 1).astype(np.int32)  # (steps, seqs)
    orders = np.argsort(-ends, axis=1, kind="stable").astype(np.int32)  # (steps, seqs)
    counts = np.arange(n + 1, dtype=np.int32)
    prev = everyone = np.arange(n)
    for j in range(steps):
        live = np.flatnonzero(ks > j + 1)
        m = len(live)
        tables, rows = first.block_tables, everyone[:m]
        pos, slot, end, order = positions[j], slots[j], ends[j], orders[j]
        if m < n:  # some sequences have drafted all they may: the others' rows
            tables, pos, slot, end = tables[live], pos[live], slot[live], end[live]
            order = np.argsort(-end, kind="stable").astype(np.int32)
        yield (
            StepInput(
                input_ids=np.zeros(m, np.int64),  # all carried
                positions=pos,
                slot_mapping=slot,
                cu_seqlens_q=counts[: m + 1],
                context_lens=end,
                block_tables=tables,
                sample_rows=rows,
                carry_index=rows,
                carry_rows=rows if m == len(prev) else np.searchsorted(prev, live),
                max_seqlen_q=1,
                is_decode=True,
                decode_order=order,
            ),
            live,
        )
        prev = live
