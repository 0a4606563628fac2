"""Requests in, for the LLM and the server alike: a prompt (text or token ids) or a chat
conversation, with its SamplingParams, becomes the token ids the engine queues, or a
`Problem` (message, param, code) that says why not, in the same words offline and served.

Chat templates are rendered here, with one set of reserved keys; every per-request limit
is checked here (`validate_request`, which the engine's add_request asks too). One limit
differs by contract, not by place: the server refuses a prompt plus max_tokens past
max_model_len (OpenAI's API does), the LLM ends such a completion there (the staged API
does). What the params alone decide was checked when they were set (validate.py);
generation_config.json's defaults are applied when the engine queues the request
(`SamplingParams.resolve`)."""

import numbers

from ..sampling_params import SamplingParams
from ..validate import Problem, is_int, show
from .structured import check_available

# apply_chat_template's own arguments, which chat_template_kwargs may not set: the model's
# template is rendered, whole, as text ending in the assistant's turn. Every one of them would
# break that: another template or conversation (chat_template, conversation), another ending
# (add_generation_prompt, continue_final_message), another output than text (tokenize,
# return_dict, return_tensors, return_assistant_tokens_mask, padding, truncation, max_length,
# tokenizer_kwargs), or features the engine does not serve (tools, documents).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "return_tensors",
        "return_assistant_tokens_mask",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "tools",
        "documents",
    }
)


def template_messages(messages) -> list[dict]:
    """A conversation as the template takes it: each message's content one string (a list of
    text parts, as OpenAI's API sends them, is joined; None is "")."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and "role" in m for m in messages)
    ):
        raise Problem(
            'a conversation must be a non-empty list of {"role": ..., "content": ...} dicts',
            "messages",
        )
    return [_template_message(i, m) for i, m in enumerate(messages)]


def _template_message(i: int, message: dict) -> dict:
    role, content = message["role"], message.get("content")
    if not isinstance(role, str):
        raise Problem(f"messages[{i}]['role'] must be a string, got {show(role)}", "messages")
    if isinstance(content, list):
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text") or "", str)
            for p in content
        ):
            raise Problem(
                f"messages[{i}]['content']: only text content parts "
                '({"type": "text", "text": ...}) are supported',
                "messages",
            )
        content = "".join(p.get("text") or "" for p in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise Problem(
            f"messages[{i}]['content'] must be a string or a list of text parts, "
            f"got {show(content)}",
            "messages",
        )
    return {**message, "content": content}


def render_chat(tokenizer, messages, chat_template_kwargs: dict | None = None) -> str:
    """The conversation in the model's chat template, ending with the assistant's generation
    prompt (`chat_template_kwargs`, e.g. {"enable_thinking": False}, go to the template)."""
    kwargs = {} if chat_template_kwargs is None else chat_template_kwargs
    if not isinstance(kwargs, dict):
        raise Problem(
            "chat_template_kwargs must be a dict of the template's own variables",
            "chat_template_kwargs",
        )
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys()):
        raise Problem(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the model's own template "
            "is rendered, as text for generation (set the tokenizer's chat_template to change it)",
            "chat_template_kwargs",
        )
    conversation = template_messages(messages)
    if tokenizer.chat_template is None:
        raise Problem(
            "this model's tokenizer has no chat template; give the prompt as text or token ids",
            "messages",
        )
    try:
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as err:  # noqa: BLE001 - a template that cannot render these messages
        raise Problem(f"the chat template refused the conversation: {err}", "messages") from None


def encode(tokenizer, text: str, param: str = "prompt") -> list[int]:
    """The token ids of a text prompt (no special tokens added: a template adds its own).
    verbose=False: no warning about the tokenizer's own length limit; max_model_len bounds
    a prompt."""
    try:
        return tokenizer.encode(text, add_special_tokens=False, verbose=False)
    except Exception as err:  # noqa: BLE001 - text the tokenizer cannot take
        raise Problem(f"the {param} cannot be tokenized: {err}", param) from None


def token_ids(prompt) -> list | None:
    """Token ids as a list of ints, numpy's integers (an array, or a list of them) included;
    anything else is left for validate_request to name."""
    if (
        hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1
    ):  # a numpy array, a 1-d tensor
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        return [
            int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t
            for t in prompt
        ]
    return prompt


def tokenize(tokenizer, prompt, param: str = "prompt") -> list:
    """A prompt (text, or token ids) -> token ids."""
    return encode(tokenizer, prompt, param) if isinstance(prompt, str) else token_ids(prompt)


def validate_request(
    token_ids, params, config, model_config, strict_length: bool = False
) -> Problem | None:
    """The problem with queueing `token_ids` under `params` on an engine of `config` and
    `model_config`, or None. SamplingParams checked its own fields when they were set; this
    checks what depends on the model and the engine. Nothing here needs the model's weights:
    the server's API side asks it too. A prompt plus max_tokens past max_model_len is refused
    with `strict_length` (the server, as OpenAI's API does); without it (the LLM and the engine,
    as every stage does) the completion ends at max_model_len with finish_reason "length"."""
    if not isinstance(params, SamplingParams):
        return Problem(
            f"sampling params must be a SamplingParams, got {type(params).__name__}",
            "sampling_params",
        )
    if problem := _check_prompt(token_ids, config, model_config):
        return problem
    vocab = model_config.vocab_size
    if bad := [t for t in params.stop_token_ids if t >= vocab]:
        return Problem(
            f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})", "stop_token_ids"
        )
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None and getattr(params, name) > vocab:
            return Problem(
                f"{name}={getattr(params, name)} is more than the vocabulary's {vocab} tokens", name
            )
    if params.n > config.max_num_seqs:  # more could never run together, and would starve the rest
        return Problem(
            f"n={params.n} is more than the {config.max_num_seqs} sequences this engine "
            "runs at once (max_num_seqs)",
            "n",
        )
    if (
        strict_length
        and params.max_tokens is not None
        and len(token_ids) + params.max_tokens > config.max_model_len
    ):
        return Problem(
            f"this model's maximum context length is {config.max_model_len} tokens, but "
            f"{len(token_ids) + params.max_tokens} were asked for ({len(token_ids)} in the prompt, "
            f"{params.max_tokens} for the completion)",
            "max_tokens",
            "context_length_exceeded",
        )
    if (
        params.structured_outputs is not None and config.speculative_config is not None
    ):  # verify rows take no bitmask
        return Problem(
            "structured_outputs cannot be combined with speculative decoding (this engine has a "
            "speculative_config)",
            "structured_outputs",
        )
    if params.structured_outputs is not None:
        return check_available()  # xgrammar is imported only when a request asks for a format
    return None


def _check_prompt(token_ids, config, model_config) -> Problem | None:
    if not isinstance(token_ids, (list, tuple)):
        return Problem(
            f"the prompt must be a string or a list of ints, got {type(token_ids).__name__}",
            "prompt",
        )
    wrong = next((i for i, t in enumerate(token_ids) if not is_int(t)), None)
    if wrong is not None:
        return Problem(
            "the prompt must be a string or a list of ints, "
            f"but its item {wrong} is {show(token_ids[wrong])}",
            "prompt",
        )
    if not token_ids:
        return Problem("the prompt is empty", "prompt")
    vocab = model_config.vocab_size
    if bad := [t for t in token_ids if not 0 <= t < vocab]:
        return Problem(
            f"the prompt has token ids {bad[:5]} outside the vocabulary [0, {vocab})", "prompt"
        )
    if len(token_ids) >= config.max_model_len:
        return Problem(
            f"the prompt has {len(token_ids)} tokens; max_model_len is {config.max_model_len}, "
            "which must leave room for at least one generated token",
            "prompt",
            "context_length_exceeded",
        )
    return None


def check_requests(
    prompts: list[list[int]],
    params: list[SamplingParams],
    config,
    model_config,
    prompt_param: str = "prompt",
    numbered: bool = True,
    strict_length: bool = False,
) -> None:
    """Every prompt with its params, before any is queued (a batch is all or nothing): the first
    problem raised, a prompt's named `prompt_param` (the server's chat endpoint: "messages")
    and, if `numbered`, by its place in the batch ("prompt 2 is empty")."""
    for i, (ids, p) in enumerate(zip(prompts, params)):
        if problem := validate_request(ids, p, config, model_config, strict_length):
            if problem.param != "prompt":
                raise problem
            message = (
                problem.message.replace("the prompt", f"prompt {i}", 1)
                if numbered
                else problem.message
            )
            raise Problem(message, prompt_param, problem.code)
