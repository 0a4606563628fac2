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

    def on_token(self, seq: Sequence, token_id: int, logprob: dict | None, now: float, eos_token_ids: set[int], max_model_len: int) -> str | None:
        """Record a token of `seq` just resolved; returns why the sequence ends, if it does:
        "stop" (EOS, a stop id, a stop string) or "length" (max_tokens, max_model_len). The
        text is decoded here only when there are stop strings to look for."""
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        if self.logprobs[seq.index] is not None:
            k = seq.params.logprobs  # the batch computed the most any row asked for
            self.logprobs[seq.index].append({**logprob, "top_logprobs": dict(list(logprob["top_logprobs"].items())[:k])})
        p, n = seq.params, seq.num_known_tokens - seq.num_prompt_tokens  # this token is the n-th
        reason = None
        if n >= p.min_tokens and ((not p.ignore_eos and token_id in eos_token_ids) or token_id in p.stop_token_ids):
            reason = "stop"
        elif seq.reaches_length_limit(seq.num_known_tokens, max_model_len):
            reason = "length"
        detok = self.detokenizers[seq.index]
        detok.push(token_id)
        if p.stop:
            length_before = len(detok.text)
            detok.update(final=reason is not None)
            if n >= p.min_tokens and detok.find_stop(length_before):
                reason = "stop"
        return reason

    def output(self) -> RequestOutput:
        completions = []
        for seq, detok in zip(self.seqs, self.detokenizers):
            detok.update(final=seq.is_finished)
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
        generated = max(len(seq.completion_token_ids) for seq in self.seqs)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        tpot = (self.last_token_time - self.first_token_time) / (generated - 1) if generated > 1 else None
        return RequestMetrics(ttft, tpot, len(self.prompt_token_ids), max(seq.num_prompt_hit_tokens for seq in self.seqs))
