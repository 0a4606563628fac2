"""A request as the engine tracks it: its n sequences, their text, and when things happened."""

import time

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .sequence import Sequence


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params  # resolved
        leader = Sequence(prompt_token_ids, params, index=0)
        self.seqs = [leader] + [Sequence(prompt_token_ids, params, index=i, leader=leader) for i in range(1, params.n)]
        for seq in self.seqs:
            seq.request_id = request_id
        self.detokenizers = [IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop) for _ in self.seqs]
        self.logprobs: list[list[dict] | None] = [[] if params.logprobs is not None else None for _ in self.seqs]
        self.num_emitted = [0] * params.n  # tokens of each completion handed out in earlier outputs
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def stop_reason(self, seq: Sequence, token_id: int, eos_token_ids: set[int], max_model_len: int) -> str | None:
        """Why the token just appended ends the sequence (before looking at its text), if it does."""
        p, n = seq.params, seq.num_completion_tokens
        if n >= p.min_tokens and ((not p.ignore_eos and token_id in eos_token_ids) or token_id in p.stop_token_ids):
            return "stop"
        if (p.max_tokens is not None and n >= p.max_tokens) or len(seq) >= max_model_len:
            return "length"
        return None

    def on_token(self, seq: Sequence, token_id: int, logprob: dict | None, reason: str | None, now: float) -> str | None:
        """Record a sampled token (already appended to `seq`); returns the finish reason, with stop strings."""
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        if logprob is not None and self.logprobs[seq.index] is not None:
            self.logprobs[seq.index].append(logprob)
        detok = self.detokenizers[seq.index]
        length_before = len(detok.text)
        detok.add([token_id], final=reason is not None)
        if seq.num_completion_tokens >= seq.params.min_tokens and detok.find_stop(length_before):
            reason = "stop"
        return reason

    def flush(self, seq: Sequence) -> None:
        """An aborted sequence: decode whatever its last tokens left pending."""
        self.detokenizers[seq.index].add([], final=True)

    def output(self) -> RequestOutput:
        completions = []
        for seq, detok in zip(self.seqs, self.detokenizers):
            ids = seq.completion_token_ids
            start, self.num_emitted[seq.index] = self.num_emitted[seq.index], len(ids)
            completions.append(CompletionOutput(
                index=seq.index,
                text=detok.text,
                token_ids=ids,
                delta_text=detok.delta(seq.is_finished),
                delta_token_ids=ids[start:],
                finish_reason=seq.finish_reason,
                logprobs=None if self.logprobs[seq.index] is None else list(self.logprobs[seq.index]),
            ))
        return RequestOutput(self.request_id, self.prompt_token_ids, completions, self.finished, self.metrics())

    def metrics(self) -> RequestMetrics:
        generated = max(seq.num_completion_tokens for seq in self.seqs)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        tpot = (self.last_token_time - self.first_token_time) / (generated - 1) if generated > 1 else None
        return RequestMetrics(ttft, tpot, len(self.prompt_token_ids), max(seq.num_prompt_hit_tokens for seq in self.seqs))
