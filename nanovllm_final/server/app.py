"""The HTTP face: OpenAI's /v1/completions and /v1/chat/completions (plain or streamed
as server-sent events), /v1/models, /health and /metrics, on FastAPI.

Both endpoints take one path (`Server.respond`): read the body (bounded in size and time),
parse it, tokenize and check it on a worker thread (engine/front_end.py, as the LLM does),
submit to the engine core, then answer from the handle's updates; an `Endpoint` says only how
the two differ (prompt building and the shapes of a choice). A client that goes away mid-request has its
request aborted in the engine, which frees its KV blocks at once."""

import asyncio
import json
import logging
import math
import time
from typing import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import front_end
from ..sampling_params import SamplingParams
from ..validate import Problem
from .echo import echo_choices, wants_scores
from .engine_client import EngineClient, Handle
from .limits import Limits, Workers, check_shape, decode
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    make_sampling_params,
    parse,
)
from .response_format import GrammarCheck
from .router_endpoints import add_router_endpoints
from .tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("nanovllm.server")
CUT_OFF_SEND_S = (
    1.0  # how long a stream cut off for slow reading waits to hand over its error event and [DONE]
)
MIN_LOGPROB = -9999.0  # what a logprob of -inf is written as (JSON has no infinity)


class EventStream(StreamingResponse):
    """Server-sent events that notice a client going away even while no token is due, and
    end a stream cut off for reading too slowly; `on_close` runs however the stream ends
    (it aborts what is left in the engine)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], handle: Handle, on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle, self.on_close = handle, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client is gone
                    group.cancel_scope.cancel()

                async def cut_off() -> None:
                    await self.handle.cut_off.wait()
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(cut_off)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
            if (
                self.handle.cut_off.is_set()
            ):  # the last events go into the buffer, for a client that reads on
                with anyio.move_on_after(CUT_OFF_SEND_S):
                    last = _sse(self.handle.error.body()) + "data: [DONE]\n\n"
                    try:
                        await send(
                            {
                                "type": "http.response.body",
                                "body": last.encode(),
                                "more_body": False,
                            }
                        )
                    except (OSError, RuntimeError):
                        pass  # the client is gone, or the response never started
        finally:
            await self.body_iterator.aclose()
            self.on_close()


class Reply:
    """One HTTP request's choices as its handle's updates fill them (on the event loop)."""

    def __init__(self, handle: Handle, keep_logprobs: bool):
        count = len(handle.choices)
        self.handle, self.done = handle, False
        self.text: list[list[str]] = [[] for _ in range(count)]
        self.num_tokens = [0] * count
        self.logprobs: list[list[dict]] = [[] for _ in range(count)]
        self.keep_logprobs = keep_logprobs  # a plain response writes them all at the end
        self.finish_reason: list[str | None] = [None] * count

    async def updates(self) -> AsyncIterator[dict[int, list]]:
        """Per wake-up: {choice: [new text, new token ids, new logprob entries, finish reason]},
        everything that arrived since the last one merged (a slow client gets fewer, larger chunks)."""
        while not self.done:
            items = [await self.handle.queue.get()]
            while not self.handle.queue.empty():
                items.append(self.handle.queue.get_nowait())
            merged: dict[int, list] = {}
            for item in items:
                if item[0] == "error":
                    raise item[1]
                if item[0] != "updates":
                    continue
                for index, text, ids, logprobs, reason in item[1]:
                    m = merged.setdefault(index, ["", [], [], None])
                    m[0] += text
                    m[1] += ids
                    m[2] += logprobs
                    m[3] = reason or m[3]
                self.done = self.done or item[2]
            for index, (text, ids, logprobs, reason) in merged.items():
                self.text[index].append(text)
                self.num_tokens[index] += len(ids)
                if self.keep_logprobs:
                    self.logprobs[index] += logprobs
                self.finish_reason[index] = reason or self.finish_reason[index]
            if merged:
                yield merged
            failed = [i for i, m in merged.items() if m[3] == "error"]
            if failed:  # a step failed on this request (the engine goes on with the others)
                raise RequestError(
                    f"the engine failed while generating choice {failed[0]}",
                    status=500,
                    code="engine_error",
                )

    def usage(self) -> dict:
        prompt_tokens = sum(len(p) for p in self.handle.prompts)
        completion_tokens = sum(self.num_tokens)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.handle.cached_tokens)},
        }


class Endpoint:
    """What /v1/completions does differently from /v1/chat/completions: the prompt and the shapes."""

    def __init__(self, server: "Server", chat: bool):
        self.server, self.chat = server, chat
        self.request_class = ChatCompletionRequest if chat else CompletionRequest
        self.prefix, self.prompt_param = ("chatcmpl", "messages") if chat else ("cmpl", "prompt")
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def prompts(self, req) -> list[list[int]]:
        """On a worker thread: the token ids of each prompt (chat: the model's template), through
        the front end the LLM uses (engine/front_end.py)."""
        tokenizer = self.server.client.tokenizer
        if self.chat:
            messages = [m.template_dict() for m in req.messages]
            text = front_end.render_chat(tokenizer, messages, req.chat_template_kwargs)
            return [front_end.encode(tokenizer, text, "messages")]
        return [front_end.tokenize(tokenizer, p) for p in req.prompts()]

    def max_tokens(self, req) -> int | None:
        return req.requested_max_tokens if self.chat else 1 if req.score_only else req.max_tokens

    def want_logprobs(self, req) -> bool:
        return bool(req.logprobs) if self.chat else req.logprobs is not None

    def logprobs(self, entries: list[dict], offset: int = 0) -> dict:
        return (
            self.server.chat_logprobs(entries)
            if self.chat
            else self.server.completion_logprobs(entries, offset)
        )

    def choice(
        self, index: int, text: str, logprobs: dict | None, finish_reason: str | None, chunk: bool
    ) -> dict:
        if not self.chat:
            return {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        content = (
            {"delta": {"content": text} if text else {}}
            if chunk
            else {"message": {"role": "assistant", "content": text}}
        )
        return {"index": index, **content, "logprobs": logprobs, "finish_reason": finish_reason}


class Server:
    """The application's state: the engine client, the endpoints, and what requests are checked against."""

    def __init__(
        self,
        client: EngineClient,
        served_model_names: list[str],
        shutdown_grace_s: float = 5.0,
        limits: Limits | None = None,
    ):
        self.client = client
        self.names = served_model_names
        self.max_model_len = client.config.max_model_len
        self.shutdown_grace_s = shutdown_grace_s
        self.limits = limits or Limits()
        self.workers = Workers(self.limits)
        self.created = int(time.time())
        self.endpoints = {False: Endpoint(self, chat=False), True: Endpoint(self, chat=True)}
        self.grammar_check = GrammarCheck(client)
        self._token_text: dict[int, str] = {}

    # ---- one request, either endpoint ----

    async def respond(self, endpoint: Endpoint, request: Request):
        arrival = asyncio.get_running_loop().time()
        body = await self.read_body(request)
        req, prompts, params = await self.workers.run(body, lambda raw: self.prepare(endpoint, raw))
        limit = self.limits.request_timeout_s
        left = (
            None if limit is None else max(0.0, arrival + limit - asyncio.get_running_loop().time())
        )
        await self.grammar_check(params)  # a grammar that does not compile is a 400 here
        try:
            handle = await asyncio.wait_for(self.submit(prompts, params, endpoint.prefix), left)
        except asyncio.TimeoutError:
            raise self.timeout_error() from None
        timer = self.deadline(handle, arrival)
        reply = Reply(handle, keep_logprobs=not req.stream)
        head = {
            "id": handle.request_ids[0],
            "object": endpoint.object,
            "created": int(handle.created),
            "model": self.names[0],
        }
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunk_head = {**head, "object": endpoint.chunk_object}

            def on_close() -> None:
                if timer is not None:
                    timer.cancel()
                if not reply.done:
                    self.client.abort(handle)

            return EventStream(
                self.stream(endpoint, req, reply, chunk_head, include_usage), handle, on_close
            )
        try:
            await self.collect(request, reply)
        finally:
            if timer is not None:
                timer.cancel()
        if wants_scores(
            req
        ):  # the choices first: a score-only one counts no completion tokens in usage
            return {**head, "choices": echo_choices(self, req, reply), "usage": reply.usage()}
        want = endpoint.want_logprobs(req)
        return {
            **head,
            "choices": [
                endpoint.choice(
                    i,
                    "".join(reply.text[i]),
                    endpoint.logprobs(reply.logprobs[i]) if want else None,
                    reply.finish_reason[i],
                    chunk=False,
                )
                for i in range(len(reply.text))
            ],
            "usage": reply.usage(),
        }

    def prepare(self, endpoint: Endpoint, body: bytes, data=None, generate: bool = True) -> tuple:
        """On a worker thread: the body checked in the order of cost (limits.py), then parsed,
        tokenized and validated -> (request, prompt token ids, SamplingParams; None unless
        `generate`: a prompt only tokenized is not held to the pending budget)."""
        in_flight = self.client.in_flight if generate else 0
        if data is None:
            data = decode(
                body, endpoint.chat, in_flight, self.client.max_pending, self.max_model_len
            )
        else:
            check_shape(data, endpoint.chat, in_flight, self.client.max_pending, self.max_model_len)
        req = parse(endpoint.request_class, data)
        if req.model is not None and req.model not in self.names:
            raise RequestError(
                f"the model {req.model!r} does not exist here; this server serves {self.names[0]!r}",
                "model",
                status=404,
                code="model_not_found",
            )
        req.check_supported()
        try:
            prompts = endpoint.prompts(req)
            return req, prompts, self.sampling_params(req, prompts, endpoint) if generate else None
        except Problem as problem:
            raise RequestError.of(problem) from None

    async def read_body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        too_big = RequestError(
            f"the request body is larger than {limit} bytes", status=413, code="request_too_large"
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            return await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                status=408,
                code="timeout",
            ) from None

    def sampling_params(self, req, prompts: list[list[int]], endpoint: Endpoint) -> SamplingParams:
        """The request's SamplingParams, checked with each prompt as the LLM checks them (max_tokens
        unset: until max_model_len)."""
        params = make_sampling_params(
            {**req.sampling_kwargs(), "max_tokens": endpoint.max_tokens(req)}
        )
        front_end.check_requests(
            prompts,
            [params] * len(prompts),
            self.client.config,
            self.client.model_config,
            endpoint.prompt_param,
            numbered=len(prompts) > 1,
            strict_length=True,
        )
        return params

    def timeout_error(self) -> RequestError:
        return RequestError(
            f"the request did not finish within {self.limits.request_timeout_s:g} s (the server's "
            "request timeout)",
            status=504,
            code="timeout",
        )

    def deadline(self, handle: Handle, arrival: float) -> asyncio.TimerHandle | None:
        """--request-timeout: past it, the request is aborted and answered with a 504."""
        limit = self.limits.request_timeout_s
        if limit is None:
            return None

        def expire() -> None:
            handle.error = self.timeout_error()
            self.client.abort(handle)
            handle.queue.put_nowait(("error", handle.error))

        loop = asyncio.get_running_loop()
        return loop.call_later(max(0.0, arrival + limit - loop.time()), expire)

    async def submit(self, prompts: list[list[int]], params, prefix: str) -> Handle:
        handle = self.client.submit(prompts, params, prefix)
        try:
            kind, payload = await handle.queue.get()  # the engine took it, or said why not
        except asyncio.CancelledError:
            self.client.abort(handle)
            raise
        if kind == "error":
            raise payload
        return handle

    async def collect(self, request: Request, reply: Reply) -> None:
        """Wait for every choice to finish; abort the request if the client leaves first."""

        async def run() -> None:
            async for _ in reply.updates():
                pass

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = (
                not work.done()
            )  # (a cancelled task is done only once the cancellation is delivered)
            if left:
                work.cancel()
                self.client.abort(reply.handle)
        if left:
            raise RequestError("the client disconnected", status=499)
        work.result()

    async def stream(
        self, endpoint: Endpoint, req, reply: Reply, head: dict, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE: chat's role chunks, a chunk per choice with news, usage, [DONE]. Usage comes on the
        last chunk, or (stream_options.include_usage) on a chunk of its own."""
        want = endpoint.want_logprobs(req)
        offsets = [0] * len(reply.text)
        try:
            if endpoint.chat:
                for i in range(len(reply.text)):
                    yield _sse(
                        {
                            **head,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
            async for merged in reply.updates():
                last = len(merged) - 1
                for k, (index, (text, ids, entries, reason)) in enumerate(merged.items()):
                    logprobs = None
                    if want and (entries or not endpoint.chat):
                        logprobs = endpoint.logprobs(entries, offsets[index])
                        offsets[index] += len(text)
                    chunk = {
                        **head,
                        "choices": [endpoint.choice(index, text, logprobs, reason, chunk=True)],
                    }
                    if include_usage:
                        chunk["usage"] = None
                    elif reply.done and k == last:
                        chunk["usage"] = reply.usage()
                    yield _sse(chunk)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": reply.usage()})
        except RequestError as err:
            yield _sse(err.body())
        yield "data: [DONE]\n\n"

    # ---- formatting ----

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.client.tokenizer.decode([token_id])
        return text

    def completion_logprobs(self, entries: list[dict], offset: int = 0) -> dict:
        """OpenAI's legacy format: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens = [self.token_text(e["token_id"]) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [self.finite(e["logprob"]) for e in entries],
            "top_logprobs": [
                None if e["top_logprobs"] is None else self.top_logprobs(e) for e in entries
            ],
            "text_offset": offsets,
        }

    def top_logprobs(self, entry: dict) -> dict[str, float]:
        """The top k by text, and the chosen token's even when it is not among them (as OpenAI and vLLM do)."""
        top = entry["top_logprobs"] | {entry["token_id"]: entry["logprob"]}
        return {self.token_text(int(t)): _finite(lp) for t, lp in top.items()}

    @staticmethod
    def finite(logprob: float | None) -> float | None:
        return None if logprob is None else _finite(logprob)

    def chat_logprobs(self, entries: list[dict]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self.token_text(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

        return {
            "content": [
                {
                    **item(e["token_id"], e["logprob"]),
                    "top_logprobs": [
                        item(int(t), lp) for t, lp in (e.get("top_logprobs") or {}).items()
                    ],
                }
                for e in entries
            ]
        }


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="nanovllm", docs_url=None, redoc_url=None)
    app.state.server = server
    _add_error_handlers(app, server.client.metrics)
    _add_status_routes(app, server)
    add_tokenizer_routes(app, server)
    add_router_endpoints(app, server)
    _add_completion_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI, metrics) -> None:
    """Every error as OpenAI's JSON error body; refusals counted by reason in /metrics."""

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError):
        if err.status in (400, 404, 408, 413):
            metrics.rejected("bad_request")
        elif err.code == "overloaded":
            metrics.rejected("overload")
        return JSONResponse(
            err.body(),
            status_code=err.status,
            headers={"Retry-After": "1"} if err.status == 503 else None,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        return JSONResponse(
            RequestError(str(err.detail), status=err.status_code).body(),
            status_code=err.status_code,
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        log.exception("internal error")
        return JSONResponse(
            RequestError(f"internal error: {type(err).__name__}: {err}", status=500).body(),
            status_code=500,
        )


def _add_status_routes(app: FastAPI, server: Server) -> None:
    """/health, /v1/models and /metrics."""
    client, metrics = server.client, server.client.metrics

    @app.get("/health")
    async def health():
        if client.error is not None or not client.alive:
            return JSONResponse(
                {"status": "engine stopped", "error": client.error}, status_code=503
            )
        if not client.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.names[0],
                    "object": "model",
                    "created": server.created,
                    "owned_by": "nanovllm",
                    "root": client.config.model,
                    "max_model_len": server.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render(
            await client.gauges(),
            {
                "in_flight": client.in_flight,
                "max_pending": client.max_pending,
                "healthy": client.alive,
            },
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_completion_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.respond(server.endpoints[False], request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.respond(server.endpoints[True], request)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _finite(logprob: float) -> float | None:
    """A logprob JSON can carry: -inf as MIN_LOGPROB, NaN as null."""
    if math.isnan(logprob):
        return None
    return max(MIN_LOGPROB, min(logprob, -MIN_LOGPROB))


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'), allow_nan=False)}\n\n"
