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

It runs on rank 0 only, one device, eager or from the draft runner's own decode CUDA graphs."""

import dataclasses

import torch

from ..config import EngineConfig, ModelConfig
from .model_runner import ModelRunner
from .sequence import Sequence
from .step_input import build_step_input


class _NoScoring:
    prompt_logprobs = None


class DraftView:
    """A sequence as the draft's step builder reads it: `token_ids`, of which the first `start`
    are in the draft's cache and the rest are fed; the target's block table."""

    params = _NoScoring()
    num_pending, spec_token_ids, index = 0, [], 0

    def __init__(self, seq: Sequence, token_ids: list[int], start: int):
        self.seq_id, self.block_table, self.token_ids = seq.seq_id, seq.block_table, token_ids
        self.num_prompt_tokens, self.num_prompt_scored = seq.num_prompt_tokens, seq.num_prompt_tokens
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
        self.runner = ModelRunner(draft_config, ModelConfig.from_dir(draft_dir), rank=0)
        self.block_size = config.kvcache_block_size

    def step(self, views: list[DraftView]) -> list[int]:
        """One draft step over the views; each one's next token (argmax)."""
        logits = self.runner.execute(build_step_input(views, self.block_size))  # (views, vocab)
        return logits.argmax(dim=-1).tolist()

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """ks[i] tokens for each sequence (whose slots the scheduler has given it)."""
        out: list[list[int]] = [[] for _ in seqs]
        views = [
            DraftView(seq, seq.token_ids, min(seq.num_draft_cached, len(seq.token_ids) - 1)) for seq in seqs
        ]
        live = list(range(len(seqs)))  # the sequences still drafting
        for _ in range(max(ks, default=0)):
            for i, token in zip(live, self.step([views[i] for i in live])):
                out[i].append(token)
            live = [i for i in live if len(out[i]) < ks[i]]
            for i in live:
                views[i] = DraftView(seqs[i], views[i].token_ids + [out[i][-1]], len(views[i].token_ids))
        return out

    def shutdown(self) -> None:
        self.runner.shutdown()
