"""What the engine returns after each step, per request (vLLM's RequestOutput / CompletionOutput)."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's n completions, as of this step."""

    index: int  # 0..n-1
    text: str  # everything decoded so far (a stop string and what follows it are cut)
    token_ids: list[int]  # every generated token so far
    delta_text: str  # text new in this step (held back while it could be the start of a stop string)
    delta_token_ids: list[int]  # tokens new in this step
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    logprobs: list[dict] | None  # per token {"token_id", "logprob", "top_logprobs": {id: logprob}}; None if not asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason, "logprobs": self.logprobs}


@dataclass
class RequestMetrics:
    ttft_s: float | None  # arrival to first generated token
    tpot_s: float | None  # mean time per generated token after the first
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens found in the prefix cache (the most any completion found)

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

    def as_dict(self) -> dict:
        """The dict `LLM.generate` returns: the first completion's fields, plus all of them in `outputs`."""
        return {
            **self.outputs[0].as_dict(),
            "prompt_token_ids": self.prompt_token_ids,
            "metrics": self.metrics.as_dict(),
            "outputs": [o.as_dict() for o in self.outputs],
        }
