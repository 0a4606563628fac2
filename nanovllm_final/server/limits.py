"""What one request may take, checked in the order of what it costs to check.

1. The body's size (bytes counted as they arrive, on the event loop): past `max_body_bytes`, 413.
2. Everything after that runs on a worker thread, never on the event loop: JSON decoding,
   then the body's *shape* (`check_shape`: prompts x n against the pending budget, the count
   of chat messages), before pydantic builds objects from it or a tokenizer sees a prompt.
   A batch of 900,000 prompts is refused after one `json.loads`, not after 900,000 encodes.
3. Then pydantic, the template, tokenizing and `validate_request`.

The worker threads are two pools: bodies up to `large_body_bytes` go to one, larger bodies
to the other, so that a small request never waits behind a large one's parse. At most
`max_large_waiting` large bodies wait for their pool (each holds up to `max_body_bytes`);
past that a large body gets 503 at once, which bounds the memory the large bodies take.
"""

import asyncio
import gc
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .protocol import RequestError


class Limits:
    """What one request may take: body bytes, seconds to send the body, worker threads for
    small bodies (`tokenizer_threads`) and for bodies above `large_body_bytes` (`large_threads`),
    large bodies waiting at most, and seconds a request may take from arrival (None: no deadline)."""

    def __init__(
        self,
        max_body_bytes: int = 8 << 20,
        body_timeout_s: float = 30.0,
        tokenizer_threads: int = 4,
        large_body_bytes: int = 256 << 10,
        large_threads: int = 1,
        max_large_waiting: int = 8,
        request_timeout_s: float | None = None,
    ):
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.tokenizer_threads, self.large_threads = tokenizer_threads, large_threads
        self.large_body_bytes, self.max_large_waiting = large_body_bytes, max_large_waiting
        self.request_timeout_s = request_timeout_s


class Workers:
    """The two thread pools that parse and tokenize request bodies (off the event loop)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.small = ThreadPoolExecutor(
            limits.tokenizer_threads, thread_name_prefix="nanovllm-parse"
        )
        self.large = ThreadPoolExecutor(
            limits.large_threads, thread_name_prefix="nanovllm-parse-large"
        )
        self.large_waiting = 0  # large bodies queued or being parsed (event loop only)

    async def run(self, body: bytes, work: Callable[[bytes], Any]) -> Any:
        """`work(body)` on the pool for the body's size; a large body past the queue's bound is a 503."""
        loop = asyncio.get_running_loop()
        if len(body) <= self.limits.large_body_bytes:
            return await loop.run_in_executor(self.small, work, body)
        if self.large_waiting >= self.limits.max_large_waiting:
            raise RequestError(
                f"{self.large_waiting} large request bodies are being parsed; retry later",
                status=503,
                code="overloaded",
            )
        self.large_waiting += 1
        try:
            return await loop.run_in_executor(self.large, work, body)
        finally:
            self.large_waiting -= 1


def check_shape(data: Any, chat: bool, in_flight: int, max_pending: int, max_messages: int) -> None:
    """From the decoded JSON alone (no pydantic object, no token yet): the sequences it asks
    for (prompts x n) against what the server takes, and the count of chat messages (each is
    at least one token of the context). Fields of the wrong type pass: pydantic names them."""
    if not isinstance(data, dict):
        return
    n = data.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompts = 1
    if chat:
        messages = data.get("messages")
        if isinstance(messages, list) and len(messages) > max_messages:
            raise RequestError(
                f"{len(messages)} messages are more than the {max_messages} tokens of this model's "
                "context (max_model_len)",
                "messages",
                code="context_length_exceeded",
            )
    elif (
        isinstance(prompt := data.get("prompt"), list) and prompt and not isinstance(prompt[0], int)
    ):
        prompts = len(prompt)
    count = prompts * n
    if count > max_pending:
        raise RequestError(
            f"{prompts} prompts x n={n} are {count} sequences, more than the {max_pending} this "
            "server runs at once",
            "n" if n > 1 else "prompt",
        )
    if in_flight + count > max_pending:
        raise RequestError(
            f"the server is overloaded: {in_flight} sequences in flight, at most {max_pending}; "
            "retry later",
            status=503,
            code="overloaded",
        )


def parse_json(raw: bytes):
    """A request body as JSON, strictly: no NaN or Infinity, no lone surrogates; a body nested
    too deeply or with an integer too long to convert is a 400 like any other bad JSON."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
        if _SURROGATE_ESCAPE.search(
            raw
        ):  # (the whole body is re-encoded only when it may hold one)
            json.dumps(data, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise RequestError("the request body is nested too deeply") from None
    except UnicodeEncodeError as err:
        lone = err.object[err.start : err.end]
        raise RequestError(
            f"the request body has a lone surrogate ({lone!r}), which is not text"
        ) from None
    except (
        ValueError,
        UnicodeDecodeError,
    ) as err:  # JSONDecodeError, NaN, an int of too many digits
        raise RequestError(f"the request body is not valid JSON: {err}") from None
    return data


def decode(raw: bytes, chat: bool, in_flight: int, max_pending: int, max_messages: int):
    """parse_json, then check_shape; a body refused is freed here, on the worker thread. The
    collector waits meanwhile: JSON has no cycles, and a million containers would otherwise
    set off collections of the whole heap, which hold up every thread."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        data = parse_json(raw)
        try:
            check_shape(data, chat, in_flight, max_pending, max_messages)
        except RequestError:
            data = None  # (the traceback keeps this frame, not the body)
            raise
        return data
    finally:
        if collecting:
            gc.enable()


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")
