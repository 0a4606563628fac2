"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of each prompt token given
the ones before it, and the k most likely tokens at each position; the first has none (None).

The position p of a prompt predicts its token p + 1, so a step that feeds positions [a, b) of
a prompt of P tokens scores the positions [a, min(b, P - 1)): the last position of a chunk
predicts the first token of the next chunk, known already (prompts are known in full). A
sequence's positions are scored once: `num_prompt_scored` counts those launched, so a
prompt recomputed after a preemption is not scored again.

The prefix cache is not read for a prompt until its positions are scored (vLLM's choice): a
cached block has K/V but no logits, so its positions would have nothing to score. Its blocks
are still registered, so later prompts may share them.

The logits of the scored rows are computed `chunk_rows` rows at a time (as many rows as a step
may sample, so the warm-up step's peak memory covers them): a long prompt never holds
prompt x vocabulary logits at once, only (chunk_rows, vocab) and each row's k best."""

import torch

from ..layers.sampler import logprobs_of
from .prompt_scoring import PromptScoring
from .sampling import PendingSample
from .sequence import Sequence
from .step_input import to_device


@torch.inference_mode()
def score_rows(
    model, hidden: torch.Tensor, scoring: PromptScoring, chunk_rows: int
) -> PendingSample | None:
    """On every rank (the LM head gathers on rank 0): the scored rows' logprobs, `chunk_rows` rows
    of logits at a time, their copies to the host queued; None on the other ranks."""
    device = hidden.device
    rows, targets = to_device(scoring.rows, device), to_device(scoring.targets, device)  # (scored,)
    parts = []
    for start in range(0, len(rows), chunk_rows):
        logits = model.compute_logits(
            hidden[rows[start : start + chunk_rows]]
        )  # (chunk, vocab) on rank 0
        if logits is not None:
            parts.append(logprobs_of(logits, targets[start : start + chunk_rows], scoring.num_top))
    if not parts:
        return None
    chosen, top_values, top_ids = (
        torch.cat(column) for column in zip(*parts)
    )  # (scored,), (scored, k), (scored, k)
    return PendingSample(targets, (chosen, top_values, top_ids))


def collect_scores(
    scoring: PromptScoring, scores: PendingSample, seqs: list[Sequence], requests: dict
) -> None:
    """Wait for the step's scores; append each sequence's to its request's prompt_logprobs
    (the top k cut to the k it asked for)."""
    entries = scores.result().logprobs  # (scored,) {"token_id", "logprob", "top_logprobs"}
    offset = 0
    for i, count in zip(scoring.owners, scoring.counts):
        seq = seqs[i]
        request = requests.get(seq.request_id)
        if request is not None and not seq.is_finished:
            k = seq.params.prompt_logprobs
            request.prompt_logprobs += [
                {**e, "top_logprobs": dict(list(e["top_logprobs"].items())[:k])}
                for e in entries[offset : offset + count]
            ]
        offset += count
