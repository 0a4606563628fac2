"""What the engine returns after each step, per request (vLLM's RequestOutput / CompletionOutput).

Outputs are deltas: a step hands out only each completion's new token ids (and their
logprobs). The text is decoded when it is read, never by the engine for its own sake:
`delta_text` is the text new since the last delta read; `text`, `token_ids` and `logprobs`
are the whole completion, meant for a finished output (read on a running one, they give
the completion as it stands when read)."""

from dataclasses import dataclass, field
from typing import Protocol


class CompletionSource(Protocol):
    """Where a completion's text and history live (the engine's request, engine/request.py)."""

    def text(self, finished: bool) -> str: ...
    def delta_text(self, finished: bool) -> str: ...
    def token_ids(self) -> list[int]: ...
    def logprobs(self) -> list[dict] | None: ...


class CompletionOutput:
    """One of a request's n completions: what this step added to it."""

    __slots__ = (
        "index",
        "delta_token_ids",
        "delta_logprobs",
        "finish_reason",
        "_source",
        "_delta_text",
    )

    def __init__(
        self,
        index: int,
        delta_token_ids: list[int],
        delta_logprobs: list[dict] | None,
        finish_reason: str | None,
        source: CompletionSource,
    ):
        self.index = index  # 0..n-1
        self.delta_token_ids = delta_token_ids  # tokens new in this step
        self.delta_logprobs = delta_logprobs  # per new token {"token_id", "logprob", "top_logprobs": {id: logprob}}; None if not asked
        self.finish_reason = (
            finish_reason  # None while running; "stop" | "length" | "abort" | "error"
        )
        self._source, self._delta_text = source, None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def delta_text(self) -> str:
        """Text new since the last delta read (held back while it could be the start of a stop string)."""
        if self._delta_text is None:
            self._delta_text = self._source.delta_text(self.finished)
        return self._delta_text

    @property
    def text(self) -> str:
        """Everything decoded (a stop string and what follows it are cut)."""
        return self._source.text(self.finished)

    @property
    def token_ids(self) -> list[int]:
        return self._source.token_ids()

    @property
    def logprobs(self) -> list[dict] | None:
        return self._source.logprobs()

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "logprobs": self.logprobs,
        }


@dataclass
class RequestMetrics:
    ttft_s: float | None  # arrival to first generated token
    tpot_s: float | None  # mean time per generated token after the first
    prompt_tokens: int
    cached_prompt_tokens: (
        int  # prompt tokens found in the prefix cache (the most any completion found)
    )

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # all n completions are done
    metrics: RequestMetrics = field(default=None)
    error: str | None = None  # why the request failed (its completions' finish_reason is "error")
    # SamplingParams.prompt_logprobs: per prompt token None (the first) or {"token_id", "logprob", "top_logprobs"},
    # once the whole prompt is scored; None before, or if not asked
    prompt_logprobs: list[dict | None] | None = None

    def as_dict(self) -> dict:
        """The dict `LLM.generate` returns: the first completion's fields, plus all of them in `outputs`."""
        return {
            **self.outputs[0].as_dict(),
            "prompt_token_ids": self.prompt_token_ids,
            "prompt_logprobs": self.prompt_logprobs,
            "metrics": self.metrics.as_dict(),
            "outputs": [o.as_dict() for o in self.outputs],
            **({"error": self.error} if self.error is not None else {}),
        }
