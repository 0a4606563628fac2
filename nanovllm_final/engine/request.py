"""A request as the engine tracks it: its n sequences, their text, and when things happened.

Per step the engine hands out deltas (`output`): each completion's new token ids and
logprobs, sliced from where the last output ended. Nothing that grows with a sequence is
copied or decoded per step: text is decoded only when stop strings must be looked for or
when an output's text is read."""

import time

from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from ..validate import Problem, is_int, show
from .detokenizer import IncrementalDetokenizer
from .sequence import Sequence
from .structured import accepts, check_available


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
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params  # resolved
        leader = Sequence(prompt_token_ids, params, index=0)
        self.seqs = [leader] + [Sequence(prompt_token_ids, params, index=i, leader=leader) for i in range(1, params.n)]
        for seq in self.seqs:
            seq.request_id = request_id
        self.completions = [
            Completion(seq, IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop, params.min_tokens), params.logprobs is not None)
            for seq in self.seqs
        ]
        # prompt_logprobs: one entry per prompt token (the first None), filled as the prompt's steps complete
        self.prompt_logprobs: list[dict | None] | None = None if params.prompt_logprobs is None else [None]
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
        completion = self.completions[seq.index]
        if completion.logprob_list is not None:
            k = seq.params.logprobs  # the batch computed the most any row asked for
            completion.logprob_list.append({**logprob, "top_logprobs": dict(list(logprob["top_logprobs"].items())[:k])})
        p, known = seq.params, seq.num_known_tokens
        n = known - seq.num_prompt_tokens  # this token is the n-th
        reason = None
        if n >= p.min_tokens and ((not p.ignore_eos and token_id in eos_token_ids) or token_id in p.stop_token_ids):
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
            outputs.append(CompletionOutput(seq.index, seq.token_ids[start:end], delta_logprobs, seq.finish_reason, c))
        scored = self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_token_ids)
        return RequestOutput(self.request_id, self.prompt_token_ids, outputs, self.finished, self.metrics(),
                             prompt_logprobs=self.prompt_logprobs if scored else None)

    def metrics(self) -> RequestMetrics:
        generated = max(seq.num_known_tokens - seq.num_prompt_tokens for seq in self.seqs)
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        tpot = (self.last_token_time - self.first_token_time) / (generated - 1) if generated > 1 else None
        return RequestMetrics(ttft, tpot, len(self.prompt_token_ids), max(seq.num_prompt_hit_tokens for seq in self.seqs))


def validate_request(token_ids, params, config, model_config) -> Problem | None:
    """The problem with queueing `token_ids` under `params` on an engine of `config` and
    `model_config`, or None. SamplingParams checked its own fields when they were set; this
    checks what depends on the model. Nothing here needs the model's weights: the server's
    API side asks it too."""
    if not isinstance(params, SamplingParams):
        return Problem(f"sampling params must be a SamplingParams, got {type(params).__name__}", "sampling_params")
    if not isinstance(token_ids, (list, tuple)):
        return Problem(f"the prompt must be a string or a list of ints, got {type(token_ids).__name__}", "prompt")
    wrong = next((i for i, t in enumerate(token_ids) if not is_int(t)), None)
    if wrong is not None:
        return Problem(f"the prompt must be a string or a list of ints, but its item {wrong} is {show(token_ids[wrong])}", "prompt")
    if not token_ids:
        return Problem("the prompt is empty", "prompt")
    vocab = model_config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        return Problem(f"the prompt has token ids {bad[:5]} outside the vocabulary [0, {vocab})", "prompt")
    if len(token_ids) >= config.max_model_len:
        return Problem(f"the prompt has {len(token_ids)} tokens; max_model_len is {config.max_model_len}, "
                       "which must leave room for at least one generated token", "prompt", "context_length_exceeded")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        return Problem(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})", "stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None and getattr(params, name) > vocab:
            return Problem(f"{name}={getattr(params, name)} is more than the vocabulary's {vocab} tokens", name)
    if params.structured_outputs is not None and config.speculative_config is not None:  # verify rows take no bitmask
        return Problem("structured_outputs cannot be combined with speculative decoding (this engine has a "
                       "speculative_config)", "structured_outputs")
    if params.structured_outputs is not None:
        return check_available()  # xgrammar is imported only when a request asks for a format
    return None
