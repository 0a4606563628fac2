"""What is wrong with a request, said once: the LLM, the engine's request API and the
server all ask `validate_request`, and the server maps a `Problem` to an OpenAI error."""

from .sampling_params import SamplingParams


class Problem(ValueError):
    """A value that cannot be served. `param` names the field (an OpenAI error's `param`),
    `code` is the OpenAI error code, `message` says what is wrong and what would do."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def validate_request(token_ids, params, config, model_config) -> Problem | None:
    """The problem with queueing `token_ids` under `params` on an engine of `config` and
    `model_config`, or None. Nothing here needs the model: the server's API side asks it too."""
    if not isinstance(params, SamplingParams):
        return Problem(f"sampling params must be a SamplingParams, got {type(params).__name__}", "sampling_params")
    if not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        return Problem(f"the prompt must be a string or a list of ints, got {type(token_ids).__name__}", "prompt")
    if not token_ids:
        return Problem("the prompt is empty", "prompt")
    vocab = model_config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        return Problem(f"the prompt has token ids {bad[:5]} outside the vocabulary [0, {vocab})", "prompt")
    if len(token_ids) >= config.max_model_len:
        return Problem(f"the prompt has {len(token_ids)} tokens; max_model_len is {config.max_model_len}, "
                       "which must leave room for at least one generated token", "prompt", "context_length_exceeded")
    if params.logprobs is not None and params.logprobs > vocab:
        return Problem(f"logprobs={params.logprobs} is more than the vocabulary's {vocab} tokens", "logprobs")
    return None
