"""Structured output in the server: OpenAI's `response_format` and vLLM's `structured_outputs`
extra field, on both endpoints, mapped onto SamplingParams.structured_outputs; and the grammar
compiled before the request is accepted, so that one that fails or takes too long is a 400.

    response_format {"type": "text"}                              -> no constraint
    response_format {"type": "json_object"}                       -> any JSON object
    response_format {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                                                                  -> that schema (always enforced)
    structured_outputs {"json" | "json_object" | "regex" | "choice" | "grammar": ...}  -> as vLLM"""

import asyncio

from ..engine.structured import COMPILE_TIMEOUT_S, Grammars, check_available
from ..structured_outputs import StructuredOutputsParams, to_structured
from .errors import RequestError


def structured_from(
    response_format: dict | None, structured_outputs: dict | None
) -> StructuredOutputsParams | None:
    """What a request body asks its output to match, or None; a RequestError naming the field."""
    if (
        response_format is not None
        and response_format.get("type", "text") != "text"
        and structured_outputs is not None
    ):
        raise RequestError("set response_format or structured_outputs, not both", "response_format")
    try:
        if structured_outputs is not None:
            return to_structured(structured_outputs)
    except ValueError as err:
        raise RequestError(f"structured_outputs: {err}", "structured_outputs") from None
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ValueError(
                    'json_schema must be {"name": ..., "schema": {...}, "strict": ...}'
                )
            return StructuredOutputsParams(json=spec["schema"])
    except ValueError as err:
        raise RequestError(f"response_format: {err}", "response_format") from None
    raise RequestError(
        f"response_format type must be text, json_object or json_schema, got {kind!r}",
        "response_format",
    )


class GrammarCheck:
    """Compiles a request's grammar on the API side (cached by schema, on worker threads) before
    the engine gets it: a grammar that does not compile within the time limit is a 400."""

    def __init__(self, client, timeout_s: float = COMPILE_TIMEOUT_S):
        self.client, self.timeout_s = client, timeout_s
        self.grammars: Grammars | None = None

    async def __call__(self, params) -> None:
        wanted = params.structured_outputs
        if wanted is None:
            return
        if problem := check_available():
            raise RequestError.of(problem)
        if self.grammars is None:
            model = self.client.model_config
            self.grammars = Grammars(
                self.client.tokenizer, model.vocab_size, list(model.eos_token_ids), self.timeout_s
            )
        job = self.grammars.submit(wanted)
        try:
            while job.result(self.timeout_s) is None:
                await asyncio.sleep(0.005)
        except ValueError as err:
            raise RequestError(str(err), "structured_outputs", code="invalid_grammar") from None
