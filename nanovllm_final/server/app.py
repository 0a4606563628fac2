"""The HTTP face: OpenAI's /v1/completions and /v1/chat/completions (plain or streamed
as server-sent events), /v1/models, /health and /metrics, on FastAPI.

A handler checks and tokenizes the request, submits it to the engine thread, and reads
the engine's outputs from its asyncio queue. A client that goes away mid-request has
its request aborted in the engine, which frees its KV blocks at once."""

import asyncio
import json
import logging
import time
from typing import AsyncIterator

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine_thread import EngineThread, Handle
from .metrics import engine_gauges, field_of
from .protocol import ChatCompletionRequest, CompletionRequest, RequestError, make_sampling_params, parse

log = logging.getLogger("nanovllm.server")


class EventStream(StreamingResponse):
    """Server-sent events that notice a client going away even while no token is due;
    `on_close` runs however the stream ends (it aborts what is left in the engine)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client is gone
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            self.on_close()


class Choices:
    """The choices of one HTTP request, filled from its handle's queue.

    Choice i*n + j is completion j of prompt i (OpenAI's order for a batch of prompts)."""

    def __init__(self, handle: Handle, n: int):
        self.handle, self.n = handle, n
        self.slot = {rid: i for i, rid in enumerate(handle.request_ids)}
        count = len(handle.request_ids) * n
        self.text = [""] * count
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[dict]] = [[] for _ in range(count)]
        self.finish_reason: list[str | None] = [None] * count
        self.cached_tokens = [0] * len(handle.request_ids)
        self.unfinished = set(handle.request_ids)

    @property
    def done(self) -> bool:
        return not self.unfinished

    async def updates(self) -> AsyncIterator[list[tuple[int, str, list[dict], str | None]]]:
        """Per step: [(choice index, new text, new logprob entries, finish reason or None)]."""
        while self.unfinished:
            kind, payload = await self.handle.queue.get()
            if kind == "error":
                raise payload
            if kind == "aborted":
                updates = []
                for j in range(self.n):
                    index = self.slot[payload] * self.n + j
                    if self.finish_reason[index] is None:
                        self.finish_reason[index] = "abort"
                        updates.append((index, "", [], "abort"))
                self.unfinished.discard(payload)
                yield updates
            elif kind == "outputs":
                yield [update for out in payload for update in self._apply(out)]

    def _apply(self, out) -> list[tuple[int, str, list[dict], str | None]]:
        updates = []
        base = self.slot[out.request_id] * self.n
        for c in out.outputs:
            index = base + c.index
            new_logprobs = _new_entries(c.logprobs, len(c.token_ids), len(c.delta_token_ids))
            ends_now = c.finish_reason is not None and self.finish_reason[index] is None
            self.text[index] = c.text
            self.token_ids[index] = list(c.token_ids)
            self.logprobs[index] += new_logprobs
            self.finish_reason[index] = c.finish_reason
            if c.delta_text or c.delta_token_ids or ends_now:  # a chunk per token, even one with no text yet
                updates.append((index, c.delta_text, new_logprobs, c.finish_reason))
        if out.finished:
            self.unfinished.discard(out.request_id)
            self.cached_tokens[self.slot[out.request_id]] = field_of(out.metrics, "cached_prompt_tokens") or 0
        return updates

    def usage(self, prompts: list[list[int]]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(ids) for ids in self.token_ids)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
        }


class Server:
    """The application's state: the engine thread and what requests are checked against."""

    def __init__(self, engine: EngineThread, served_model_names: list[str], shutdown_grace_s: float = 5.0):
        self.engine = engine
        self.llm = engine.llm
        self.names = served_model_names
        self.max_model_len = self.llm.config.max_model_len
        self.shutdown_grace_s = shutdown_grace_s
        self.created = int(time.time())

    # ---- checks shared by both endpoints ----

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise RequestError(f"the model {name!r} does not exist here; this server serves {self.names[0]!r}", "model", code="model_not_found")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        ids = self.llm.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.llm.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        return ids

    def sampling_params(self, kwargs: dict, prompts: list[list[int]], max_tokens: int | None, param: str):
        longest = max(len(p) for p in prompts)
        if longest >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {longest} "
                "tokens, which leaves no room for a completion", param, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = self.max_model_len - longest
        elif isinstance(max_tokens, int) and max_tokens > 0 and longest + max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but {longest + max_tokens} "
                f"were asked for ({longest} in the prompt, {max_tokens} for the completion)", "max_tokens",
                code="context_length_exceeded")
        return make_sampling_params({**kwargs, "max_tokens": max_tokens})

    async def submit(self, prompts: list[list[int]], params, prefix: str) -> Handle:
        handle = self.engine.submit(prompts, params, prefix)
        try:
            kind, payload = await handle.queue.get()  # the engine thread took it, or said why not
        except asyncio.CancelledError:
            self.engine.abort(handle)
            raise
        if kind == "error":
            raise payload
        return handle

    # ---- running a request ----

    async def collect(self, request: Request, choices: Choices) -> None:
        """Wait for every choice to finish; abort the request if the client leaves first."""

        async def run() -> None:
            async for _ in choices.updates():
                pass

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self.engine.abort(choices.handle)
        if work.cancelled():
            raise RequestError("the client disconnected", status=499)
        work.result()

    async def stream(self, choices: Choices, prompts: list[list[int]], include_usage: bool, make_chunk, first_chunks=()) -> AsyncIterator[str]:
        """SSE: the first chunks (chat's role), one chunk per choice and step, [DONE].
        Usage comes on the last chunk, or (stream_options.include_usage) on a chunk of its own."""
        try:
            for chunk in first_chunks:
                yield _sse(chunk)
            async for updates in choices.updates():
                chunks = [make_chunk(*update) for update in updates]
                for i, chunk in enumerate(chunks):
                    if include_usage:
                        chunk["usage"] = None
                    elif choices.done and i == len(chunks) - 1:
                        chunk["usage"] = choices.usage(prompts)
                    yield _sse(chunk)
            if include_usage:
                yield _sse({**make_chunk(None, "", [], None), "choices": [], "usage": choices.usage(prompts)})
        except RequestError as err:
            yield _sse(err.body())
        yield "data: [DONE]\n\n"

    def stream_response(self, choices: Choices, prompts: list[list[int]], include_usage: bool, make_chunk, first_chunks=()) -> EventStream:
        def on_close() -> None:
            if not choices.done:  # the client left, or the server is stopping
                self.engine.abort(choices.handle)

        return EventStream(self.stream(choices, prompts, include_usage, make_chunk, first_chunks), on_close)

    # ---- formatting ----

    def token_text(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id])

    def completion_logprobs(self, entries: list[dict], offset: int = 0) -> dict | None:
        """OpenAI's legacy format: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens = [self.token_text(e["token_id"]) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{self.token_text(int(t)): lp for t, lp in (e.get("top_logprobs") or {}).items()} for e in entries],
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries: list[dict]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**item(e["token_id"], e["logprob"]),
             "top_logprobs": [item(int(t), lp) for t, lp in (e.get("top_logprobs") or {}).items()]}
            for e in entries
        ]}


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None)
    app.state.server = server
    metrics = server.engine.metrics

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError):
        if err.status == 400:
            metrics.rejected("bad_request")
        return JSONResponse(err.body(), status_code=err.status, headers={"Retry-After": "1"} if err.status == 503 else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(RequestError(str(err.detail), status=err.status_code).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("internal error")
        return JSONResponse(RequestError(f"internal error: {type(err).__name__}: {err}", status=500).body(), status_code=500)

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return JSONResponse({"status": "engine stopped", "error": server.engine.error}, status_code=503)
        if not server.engine.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": server.names[0], "object": "model", "created": server.created, "owned_by": "nanovllm",
             "root": server.llm.config.model, "max_model_len": server.max_model_len}
        ]}

    @app.get("/metrics")
    async def prometheus():
        try:
            engine = await server.engine.call(engine_gauges) if server.engine.alive else None
        except Exception:  # noqa: BLE001 - the engine stopped between the check and the call
            engine = None
        text = metrics.render(engine, {"in_flight": server.engine.in_flight, "max_pending": server.engine.max_pending,
                                       "healthy": server.engine.alive})
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await _json_body(request))
        server.check_model(req.model)
        req.check_supported()
        prompts = [server.encode_prompt(p) for p in req.prompts()]
        params = server.sampling_params(req.sampling_kwargs(), prompts, req.max_tokens, "prompt")
        handle = await server.submit(prompts, params, "cmpl")
        choices = Choices(handle, req.n)
        head = {"id": handle.request_ids[0], "object": "text_completion", "created": int(handle.created), "model": server.names[0]}
        want_logprobs = req.logprobs is not None
        if req.stream:
            offsets = [0] * len(choices.text)

            def chunk(index, text, entries, finish_reason):
                logprobs = None
                if want_logprobs and index is not None:
                    logprobs = server.completion_logprobs(entries, offsets[index])
                    offsets[index] += sum(len(t) for t in logprobs["tokens"])
                return {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

            include = bool(req.stream_options and req.stream_options.include_usage)
            return server.stream_response(choices, prompts, include, chunk)
        await server.collect(request, choices)
        return {**head, "choices": [
            {"index": i, "text": choices.text[i], "finish_reason": choices.finish_reason[i],
             "logprobs": server.completion_logprobs(choices.logprobs[i]) if want_logprobs else None}
            for i in range(len(choices.text))
        ], "usage": choices.usage(prompts)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await _json_body(request))
        server.check_model(req.model)
        req.check_supported()
        messages = [m.as_template_dict() for m in req.messages]
        try:
            prompt = server.llm.encode_chat(messages, chat_template_kwargs=req.chat_template_kwargs)
        except Exception as err:  # noqa: BLE001 - a template that cannot render these messages
            raise RequestError(f"the chat template failed on these messages: {err}", "messages") from None
        prompts = [prompt]
        params = server.sampling_params(req.sampling_kwargs(), prompts, req.requested_max_tokens, "messages")
        handle = await server.submit(prompts, params, "chatcmpl")
        choices = Choices(handle, req.n)
        head = {"id": handle.request_ids[0], "object": "chat.completion", "created": int(handle.created), "model": server.names[0]}
        if req.stream:
            head["object"] = "chat.completion.chunk"

            def chunk(index, text, entries, finish_reason):
                logprobs = server.chat_logprobs(entries) if req.logprobs and entries else None
                delta = {"content": text} if text else {}
                return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

            role = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}
                    for i in range(req.n)]
            include = bool(req.stream_options and req.stream_options.include_usage)
            return server.stream_response(choices, prompts, include, chunk, role)
        await server.collect(request, choices)
        return {**head, "choices": [
            {"index": i, "message": {"role": "assistant", "content": choices.text[i]},
             "logprobs": server.chat_logprobs(choices.logprobs[i]) if req.logprobs else None,
             "finish_reason": choices.finish_reason[i]}
            for i in range(len(choices.text))
        ], "usage": choices.usage(prompts)}

    return app


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _new_entries(logprobs: list | None, num_tokens: int, num_new: int) -> list[dict]:
    """The logprob entries of this step's new tokens, whether the engine reports them
    cumulatively (one per generated token so far) or per step."""
    if not logprobs:
        return []
    return list(logprobs[num_tokens - num_new:]) if len(logprobs) == num_tokens else list(logprobs)



class GracefulServer(uvicorn.Server):
    """uvicorn's server, whose shutdown also refuses new work and, after the grace period,
    aborts what the engine still runs, so that every open stream ends with a last chunk."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.app_server = server

    async def shutdown(self, sockets=None):
        engine = self.app_server.engine
        engine.accepting = False
        asyncio.get_running_loop().call_later(self.app_server.shutdown_grace_s, engine.abort_all)
        await super().shutdown(sockets)


def run(server: Server, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM; returns once every connection is closed."""
    config = uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level, lifespan="off",
                            timeout_graceful_shutdown=server.shutdown_grace_s + 5)
    GracefulServer(config, server).run()
