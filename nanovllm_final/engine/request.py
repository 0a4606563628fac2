"""A request as the engine tracks it: its n sequences, their text, and when things happened.

Per step the engine hands out deltas (`output`): each completion's new token ids and
logprobs, sliced from where the last output ended. Nothing that grows with a sequence is
copied or decoded per step: text is decoded only when stop strings must be looked for or
when an output's text is read."""

import time

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .sequence import Sequence
from .structured import accepts


class Completion:
    """One completion's decoded text and logprobs (an output's CompletionSource)."""

    __slots__ = ("seq", "detok", "logprob_list", "num_emitted")

    def __init__(self, seq: Sequence, detok: IncrementalDetokenizer, want_logprobs: bool):
        self.seq, self.detok = seq, detok
        self.logprob_list: list[dict] | None = [] if want_logprobs else None
        self.num_emitted = 0  # tokens handed out in earlier outputs

    def text(self, finished: bool) -> str:
        self.detok.update(final=finished)
        return self.detok.text

    def delta_text(self, finished: bool) -> str:
        return self.detok.delta(finished)

    def token_ids(self) -> list[int]:
        return self.seq.completion_token_ids

    def logprobs(self) -> list[dict] | None:
        return None if self.logprob_list is None else list(self.logprob_list)


class Request:
    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params  # resolved
        leader = Sequence(prompt_token_ids, params, index=0)
        self.seqs = [leader] + [
            Sequence(prompt_token_ids, params, index=i, leader=leader) for i in range(1, params.n)
        ]
        for seq in self.seqs:
            seq.request_id = request_id
        self.completions = [
            Completion(
                seq,
                IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop, params.min_tokens),
                params.logprobs is not None,
            )
            for seq in self.seqs
        ]
        # prompt_logprobs: one entry per prompt token (the first None), filled as the prompt's steps complete
        self.prompt_logprobs: list[dict | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def on_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: dict | None,
        now: float,
        eos_token_ids: set[int],
        max_model_len: int,
    ) -> str | None:
        """Record a token of `seq` just resolved; returns why the sequence ends, if it does:
        "stop" (EOS, a stop id, a stop string) or "length" (max_tokens, max_model_len). The
        text is decoded here only when there are stop strings to look for."""
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        completion = self.completions[seq.index]
        if completion.logprob_list is not None:
            k = seq.params.logprobs  # the batch computed the most any row asked for
            completion.logprob_list.append(
                {**logprob, "top_logprobs": dict(list(logprob["top_logprobs"].items())[:k])}
            )
        p, known = seq.params, seq.num_known_tokens
        n = known - seq.num_prompt_tokens  # this token is the n-th
        reason = None
        if n >= p.min_tokens and (
            (not p.ignore_eos and token_id in eos_token_ids) or token_id in p.stop_token_ids
        ):
            reason = "stop"
        elif seq.grammar is not None and not accepts(seq, token_id, eos_token_ids):
            reason = "stop"  # the grammar has ended (its EOS accepted), or can take no token past this one
        elif seq.reaches_length_limit(known, max_model_len):
            reason = "length"
        if completion.detok.add(token_id, final=reason is not None):
            reason = "stop"
        return reason

    def output(self) -> RequestOutput:
        """What is new since the last output, per completion (O(new tokens))."""
        outputs = []
        for c in self.completions:
            seq = c.seq
            start, end = seq.num_prompt_tokens + c.num_emitted, seq.num_known_tokens
            delta_logprobs = None if c.logprob_list is None else c.logprob_list[c.num_emitted :]
            c.num_emitted = end - seq.num_prompt_tokens
            outputs.append(
                CompletionOutput(
                    seq.index, seq.token_ids[start:end], delta_logprobs, seq.finish_reason, c
                )
            )
        scored = self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(
            self.prompt_token_ids
        )
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            outputs,
            self.finished,
            self.metrics(),
            prompt_logprobs=self.prompt_logprobs if scored else None,
        )

    def metrics(self) -> RequestMetrics:
        generated = max(seq.num_known_tokens - seq.num_prompt_tokens for seq in self.seqs)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        tpot = (
            (self.last_token_time - self.first_token_time) / (generated - 1)
            if generated > 1
            else None
        )
        return RequestMetrics(
            ttft,
            tpot,
            len(self.prompt_token_ids),
            max(seq.num_prompt_hit_tokens for seq in self.seqs),
        )
