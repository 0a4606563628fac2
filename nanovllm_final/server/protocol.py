"""The OpenAI request bodies and their mapping onto SamplingParams (the error object: errors.py).

Field names and defaults follow OpenAI's API (and vLLM's extras: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, chat_template_kwargs).
Types are strict (no "5" for 5, no true for 1, no "yes" for true). Unknown fields are
ignored, as vLLM does; a known feature we do not implement with a non-default value (suffix,
logit_bias, tools, ...) is refused with a 400, and so is a client's chat template:
the server renders only the model's own."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ..sampling_params import SamplingParams
from ..validate import Problem, options
from .errors import RequestError
from .response_format import structured_from

STRICT = ConfigDict(extra="ignore", strict=True)
MAX_STOP_STRINGS, MAX_STOP_CHARS = (
    16,
    512,
)  # each generated token is checked against every stop string


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


# SamplingParams' fields that a body sets as they are, generated from their metadata (validate.py):
# unset (None), each takes SamplingParams' default. The others have OpenAI's own shapes and
# defaults, declared by each endpoint (max_tokens, logprobs, prompt_logprobs), or are mapped from
# OpenAI's fields (structured_outputs: response_format.py).
OPENAI_SHAPED = {"max_tokens", "logprobs", "prompt_logprobs", "structured_outputs"}
_Sampled = create_model(
    "_Sampled",
    __config__=STRICT,
    **{
        o.name: (o.annotation | None, Field(None, description=o.help))
        for o in options(SamplingParams)
        if o.name not in OPENAI_SHAPED
    },
)


class _Common(_Sampled):
    """Fields shared by /v1/completions and /v1/chat/completions: SamplingParams' (vLLM's extras
    among them: pass those with the openai client's extra_body=) and OpenAI's own."""

    model_config = STRICT

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # structured output (response_format.py): OpenAI's, or vLLM's extra field
    response_format: dict | None = None
    structured_outputs: dict | None = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by this server", "logit_bias")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise RequestError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
                "stop",
            )

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields the body set ("" and [""] as stop: refused by SamplingParams)."""
        kwargs = {
            name: getattr(self, name)
            for name in _Sampled.model_fields
            if getattr(self, name) is not None
        }
        if (
            structured := structured_from(self.response_format, self.structured_outputs)
        ) is not None:
            kwargs["structured_outputs"] = structured
        return kwargs


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the prompt's text (and logprobs) before the completion's: echo.py
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's extra
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream and (self.echo or self.prompt_logprobs is not None):
            raise RequestError(
                "echo and prompt_logprobs are not supported with stream=true by this server",
                "echo" if self.echo else "prompt_logprobs",
            )
        if self.max_tokens == 0 and not self.echo:
            raise RequestError(
                "max_tokens must be at least 1; 0 is allowed with echo=true (score the prompt only)",
                "max_tokens",
            )
        if self.suffix:
            raise RequestError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError(
                "best_of is not supported by this server (leave it unset or equal to n)", "best_of"
            )

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch: a string, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        return list(p)

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        if (
            self.echo and self.logprobs is not None
        ) or self.prompt_logprobs is not None:  # echo joins the prompt's
            echoed = self.logprobs if self.echo and self.logprobs is not None else 0
            kwargs["prompt_logprobs"] = max(echoed, self.prompt_logprobs or 0)
        return kwargs

    @property
    def score_only(self) -> bool:
        """max_tokens 0 with echo: the engine generates one token, which the response leaves out."""
        return self.echo and self.max_tokens == 0


class ContentPart(BaseModel):
    model_config = STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as the front end takes it (engine/front_end.py joins text parts)."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: Any = None
    functions: list[dict] | None = None  # OpenAI's legacy form of tools
    function_call: Any = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.chat_template is not None:
            raise RequestError(
                "chat_template is not accepted: this server renders the model's own template",
                "chat_template",
            )
        if self.tools:
            raise RequestError("tools are not supported by this server", "tools")
        if self.functions or self.function_call is not None:
            raise RequestError(
                "functions and function_call are not supported by this server", "functions"
            )
        if self.tool_choice not in (
            None,
            "none",
            "auto",
        ):  # "required", a named tool: a call this server cannot make
            raise RequestError(
                f"tool_choice {self.tool_choice!r} needs tools, which this server does not support",
                "tool_choice",
            )
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs


def parse(model: type[BaseModel], data: Any) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a RequestError naming its field."""
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(part) for part in first["loc"]]
        where = ".".join(loc) or "body"
        raise RequestError(f"{where}: {first['msg']}", loc[0] if loc else None) from None


def make_sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    """SamplingParams raises ValueError naming the bad field; that becomes a 400 with `param` set."""
    try:
        return SamplingParams(**kwargs)
    except Problem as problem:
        raise RequestError.of(problem) from None
    except (ValueError, TypeError) as err:
        message = str(err)
        param = next(
            (name for name in sorted(kwargs, key=len, reverse=True) if name in message), None
        )
        raise RequestError(message, param) from None
