"""The API process's side of the engine core (engine_core.py): start it, feed it, read it.

`submit` registers an HTTP request's handle first and then queues its "add" command, so
whatever happens to the engine afterwards, the handle gets an answer. A sender thread
writes the commands (the event loop never blocks on a pipe); a reader thread reads the
engine's one message per step, decodes the new tokens the engine process did not (those of
requests without stop strings: Choice) and hands each step's updates to the event loop with
one call. If the engine process dies or fails, the reader answers every request still
waiting with a 503 naming the cause, at once, and `on_dead` tells the server to exit (code 1);
so does the watchdog (watchdog.py) when the engine hangs with requests waiting.

Requests in flight are counted in sequences (prompts x n) and bounded (`max_pending`):
past it, `submit` refuses at once with a 503. A handle whose client reads more slowly
than the engine writes piles up updates; past `max_backlog` unread steps it is cut off
(`cut_off` is set, its requests are aborted)."""

import asyncio
import fcntl
import itertools
import logging
import multiprocessing as mp
import queue
import threading
import time
import uuid
from multiprocessing.connection import wait
from typing import Any, Callable

from ..engine.detokenizer import IncrementalDetokenizer
from .engine_core import engine_core_main
from .metrics import ServerMetrics
from .protocol import RequestError
from .watchdog import Heartbeat, Watchdog

log = logging.getLogger("nanovllm.server")
STOP_TIMEOUT_S = 30.0  # how long the engine process may take to shut down before it is killed
DEFAULT_WATCHDOG_S = 60.0
PIPE_BYTES = (
    1 << 20
)  # the pipes' kernel buffers: the engine's send returns at once unless we are ~that far behind


class Choice:
    """One completion as the API side hands it out. Its text is decoded once: by the engine
    process where stop strings must be matched (the text comes with the tokens), else here,
    from the token ids, off the engine's critical path."""

    __slots__ = ("detok", "finish_reason")

    def __init__(self, tokenizer, prompt: list[int], params):
        self.detok = None if params.stop else IncrementalDetokenizer(tokenizer, prompt)
        self.finish_reason: str | None = None

    def apply(
        self, ids: list[int], text: str | None, logprobs: list | None, reason: str | None
    ) -> tuple:
        """New tokens (and their text, if the engine decoded it) -> (text, ids, logprobs, finish reason)."""
        if self.detok is not None:
            for token_id in ids:
                self.detok.push(token_id)
            text = self.detok.delta(reason is not None)
        self.finish_reason = reason
        return text or "", ids, logprobs or [], reason


class Handle:
    """One HTTP request: its engine requests, and the asyncio queue their news arrive on.

    Items on `queue`: ("accepted", None) once the engine took every prompt, then
    ("updates", [(choice, text, token_ids, logprobs, finish_reason), ...], done) per step,
    or ("error", RequestError) if the engine refused it or failed. Choice i*n + j is
    completion j of prompt i (OpenAI's order for a batch of prompts)."""

    def __init__(self, loop, prefix: str, prompts: list[list[int]], params, tokenizer):
        self.loop, self.prompts, self.params, self.n = loop, prompts, params, params.n
        base = f"{prefix}-{uuid.uuid4().hex}"
        self.request_ids = (
            [base] if len(prompts) == 1 else [f"{base}-{i}" for i in range(len(prompts))]
        )
        self.slot = {rid: i for i, rid in enumerate(self.request_ids)}
        self.choices = [Choice(tokenizer, p, params) for p in prompts for _ in range(params.n)]
        self.unfinished = set(self.request_ids)  # reader thread (under the client's lock)
        self.cached_tokens = [0] * len(prompts)
        self.prompt_logprobs: list[list | None] = [None] * len(
            prompts
        )  # per prompt once scored (prompt_logprobs)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cut_off = asyncio.Event()
        self.error: RequestError | None = None  # why the server ended it (cut off, deadline)
        self.created = time.time()
        self.start = time.perf_counter()

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids) * self.n


class EngineClient:
    def __init__(
        self,
        model: str,
        engine_options: dict,
        max_pending: int | None = None,
        max_backlog: int = 256,
        metrics: ServerMetrics | None = None,
        watchdog_s: float | None = DEFAULT_WATCHDOG_S,
    ):
        """max_pending: sequences in flight past which submit() refuses; None: 4 x max_num_seqs.
        max_backlog: unread steps past which a streaming client is cut off.
        watchdog_s: seconds of a silent engine, while requests wait, before it counts as hung
        (watchdog.py); None: not watched."""
        for name, value in (("max_pending", max_pending), ("max_backlog", max_backlog)):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model, self.engine_options = model, engine_options
        self.max_pending, self.max_backlog = max_pending, max_backlog
        self.metrics = metrics or ServerMetrics()
        self.info: dict = {}
        self.config = self.model_config = self.tokenizer = None
        self.error: str | None = None  # why the engine stopped, once it has
        self.accepting = True
        self._lock = threading.Lock()
        self._in_flight = 0  # sequences submitted and not finished
        self._live: dict[str, Handle] = {}  # request id -> handle, for every request not finished
        self._adding: dict[int, Handle] = {}  # add commands the engine has not answered
        self._gauges: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._process = None
        self.watchdog_s, self._watchdog = watchdog_s, None
        self.on_dead: Callable[[], None] | None = (
            None  # called (from a thread) once the engine is dead or hung
        )
        self.failed = False  # the engine died or hung (not: stopped when told)
        self._stopping = False

    # ---- life cycle (main thread) ----

    def start(self) -> None:
        """Start the engine process and wait until it has built the engine; a failure there is
        raised here as a ValueError with the engine's message."""
        ctx = mp.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._messages, messages_out = ctx.Pipe(duplex=False)
        for conn in (self._commands, self._messages):
            try:
                fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except (OSError, AttributeError):
                pass  # not Linux, or above /proc/sys/fs/pipe-max-size: the default buffer
        self.heartbeat = Heartbeat(ctx)
        self._process = ctx.Process(
            target=engine_core_main,
            name="nanovllm-engine-core",
            args=(commands_in, messages_out, self.model, self.engine_options, self.heartbeat),
        )
        self._process.start()
        commands_in.close()  # only the engine holds these ends: if it dies, ours see EOF
        messages_out.close()
        try:
            kind, payload = self._receive()
        except KeyboardInterrupt:
            self.stop()
            raise
        if kind != "ready":
            self._process.join(STOP_TIMEOUT_S)
            raise ValueError(payload)
        from transformers import AutoTokenizer

        self.info, self.config, self.model_config = (
            payload,
            payload["config"],
            payload["model_config"],
        )
        self.tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
        self.max_pending = self.max_pending or 4 * self.config.max_num_seqs
        threading.Thread(target=self._read, name="nanovllm-engine-reader", daemon=True).start()
        threading.Thread(target=self._send, name="nanovllm-engine-sender", daemon=True).start()
        if self.watchdog_s:
            busy = lambda: self._in_flight > 0 or bool(self._adding)
            self._watchdog = Watchdog(self.heartbeat, self.watchdog_s, busy, self._on_hung)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine process (it shuts down its workers); kill it if it does not go in time."""
        self.accepting, self._stopping = False, True
        if self._process is None:
            return
        if self.info:
            self._outbox.put(("stop",))
            self._outbox.put(None)
        else:  # still building the engine, not reading commands yet
            self._process.terminate()
        if self._watchdog is not None:
            self._watchdog.stopped.set()
        self._process.join(
            timeout if self.error is None else min(timeout, 2.0)
        )  # a hung engine may not stop
        if self._process.is_alive():
            log.error("the engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(10)

    @property
    def alive(self) -> bool:
        return (
            self.error is None
            and self._process is not None
            and self._process.is_alive()
            and bool(self.info)
        )

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ---- event loop side ----

    def submit(self, prompts: list[list[int]], params, prefix: str) -> Handle:
        """Queue one HTTP request's prompts (all with the same SamplingParams)."""
        count = len(prompts) * params.n
        if count > self.max_pending:
            raise RequestError(
                f"{len(prompts)} prompts x n={params.n} are {count} sequences, more than the "
                f"{self.max_pending} this server runs at once",
                "n" if params.n > 1 else "prompt",
            )
        handle = Handle(asyncio.get_running_loop(), prefix, prompts, params, self.tokenizer)
        with self._lock:  # against the reader thread: a dead engine answers every registered handle
            if not self.accepting:
                raise RequestError("the server is shutting down", status=503, code="shutting_down")
            if self.error is not None:
                raise RequestError(
                    f"the engine is not running: {self.error}", status=503, code="engine_dead"
                )
            if self._in_flight + count > self.max_pending:
                raise RequestError(
                    f"the server is overloaded: {self._in_flight} sequences in flight, at most "
                    f"{self.max_pending}; retry later",
                    status=503,
                    code="overloaded",
                )
            self._in_flight += count
            key = next(self._keys)
            self._adding[key] = handle
            for rid in handle.request_ids:
                self._live[rid] = handle
        self._outbox.put(
            ("add", key, [(rid, p, params) for rid, p in zip(handle.request_ids, prompts)])
        )
        return handle

    def abort(self, handle: Handle, notify: bool = False) -> None:
        """Abort the handle's unfinished requests (its client went away or fell behind; with
        `notify`, the server is stopping: its open choices end with finish_reason "abort")."""
        with self._lock:
            rids = [rid for rid in handle.request_ids if self._live.get(rid) is handle]
            self._forget(rids, handle)
        for _ in rids:
            self.metrics.finished("abort")
        if rids:
            self._outbox.put(("abort", rids))
        if rids and notify:
            ended = [(handle.slot[rid] * handle.n + j) for rid in rids for j in range(handle.n)]
            updates = [
                (i, "", [], [], "abort") for i in ended if handle.choices[i].finish_reason is None
            ]
            _push(handle, ("updates", updates, True))

    def abort_all(self) -> None:
        with self._lock:
            handles = set(self._live.values())
        for handle in handles:
            self.abort(handle, notify=True)

    async def gauges(self, timeout: float = 5.0) -> dict | None:
        """The engine's queues and KV cache, read between two steps; None if it does not answer."""
        if not self.alive:
            return None
        key = next(self._keys)
        future = self._gauges[key] = asyncio.get_running_loop().create_future()
        self._outbox.put(("gauges", key))
        try:
            return await asyncio.wait_for(future, timeout)
        except (asyncio.TimeoutError, RuntimeError):
            return None
        finally:
            self._gauges.pop(key, None)

    # ---- threads ----

    def _send(self) -> None:
        while (command := self._outbox.get()) is not None:
            try:
                self._commands.send(command)
            except OSError:
                return  # the engine is gone; the reader says so

    def _receive(self) -> tuple:
        """The engine's next message; ("dead", why) once its process is gone."""
        ready = wait([self._messages, self._process.sentinel])
        if self._messages in ready or self._messages.poll():
            try:
                return self._messages.recv()
            except (EOFError, OSError):
                pass
        self._process.join(1)
        code = self._process.exitcode
        return (
            "dead",
            f"the engine process exited with code {code}"
            if code is not None
            else "the engine process is gone",
        )

    def _read(self) -> None:
        while True:
            kind, *payload = self._receive()
            if kind == "step":
                self._on_step(*payload)
            else:
                self._on_dead(payload[0] if kind == "dead" else f"unexpected message {kind!r}")
                return

    def _on_step(self, replies: list[tuple], deltas: list[tuple]) -> None:
        news: dict[Handle, list] = {}
        done: set[Handle] = set()
        for kind, key, value in replies:
            if kind == "added":
                self._on_added(key, value)
            elif kind == "gauges" and (future := self._gauges.get(key)) is not None:
                future.get_loop().call_soon_threadsafe(_set_result, future, value)
        for rid, items, metrics, prompt_logprobs in deltas:
            handle = self._live.get(rid)
            if handle is None:
                continue  # aborted: answered already
            if (
                prompt_logprobs is not None
            ):  # before the updates that follow it reach the event loop
                handle.prompt_logprobs[handle.slot[rid]] = prompt_logprobs
            updates = news.setdefault(handle, [])
            base = handle.slot[rid] * handle.n
            for index, ids, text, logprobs, reason in items:
                choice = handle.choices[base + index]
                if choice.finish_reason is None:
                    update = choice.apply(ids, text, logprobs, reason)
                    updates.append((base + index, *update))
                    self.metrics.generated(len(update[1]))
            if metrics is not None:
                self._on_finished(handle, rid, metrics)
                if not handle.unfinished:
                    done.add(handle)
        if news:  # one wake-up of the event loop per step, however many requests got tokens
            loop = next(iter(news)).loop
            try:
                loop.call_soon_threadsafe(
                    self._deliver, [(h, u, h in done) for h, u in news.items()]
                )
            except RuntimeError:
                pass  # the event loop is closed

    def _on_added(self, key: int, problem: tuple | None) -> None:
        with self._lock:
            handle = self._adding.pop(key, None)
            if handle is None:
                return
            if problem is not None:
                self._forget(
                    [rid for rid in handle.request_ids if self._live.get(rid) is handle], handle
                )
        if problem is None:
            for p in handle.prompts:
                self.metrics.prompt(len(p))
            _push(handle, ("accepted", None))
        else:
            message, param, code = problem
            _push(handle, ("error", RequestError(message, param, code=code)))

    def _on_finished(self, handle: Handle, rid: str, metrics: dict) -> None:
        with self._lock:
            if self._live.get(rid) is not handle:
                return
            self._forget([rid], handle)
            handle.unfinished.discard(rid)
        handle.cached_tokens[handle.slot[rid]] = metrics.get("cached_prompt_tokens") or 0
        base = handle.slot[rid] * handle.n
        choices = handle.choices[base : base + handle.n]
        self.metrics.observe_request(
            [c.finish_reason for c in choices], metrics, time.perf_counter() - handle.start
        )

    def _forget(self, rids: list[str], handle: Handle) -> None:
        """Under the lock: these requests of `handle` are over."""
        for rid in rids:
            del self._live[rid]
        self._in_flight -= len(rids) * handle.n

    def _deliver(self, items: list[tuple]) -> None:
        """On the event loop: queue each handle's updates; cut off a client too far behind."""
        for handle, updates, done in items:
            handle.queue.put_nowait(("updates", updates, done))
            if not done and handle.queue.qsize() > self.max_backlog and not handle.cut_off.is_set():
                log.warning(
                    "a client fell %d steps behind its stream; cutting it off", handle.queue.qsize()
                )
                self.metrics.rejected("slow_reader")
                handle.error = RequestError(
                    "the client read its stream too slowly and was cut off",
                    status=408,
                    code="slow_reader",
                )
                handle.cut_off.set()
                self.abort(handle)
                handle.queue.put_nowait(("error", handle.error))

    def _on_hung(self, why: str) -> None:
        """From the watchdog: answer every waiting request, then kill the engine process."""
        log.error("the engine looks hung: %s; killing it", why)
        self._on_dead(why, code="engine_hung")
        self._process.kill()

    def _on_dead(self, why: str, code: str = "engine_dead") -> None:
        with self._lock:
            if self.error is not None:  # the watchdog killed it: answered already
                return
            self.error, self.failed = why, not self._stopping
            handles = set(self._live.values()) | set(self._adding.values())
            self._live.clear()
            self._adding.clear()
            self._in_flight = 0
        if self.accepting:
            log.error("the engine stopped: %s; the server answers 503 and exits", why)
        for handle in handles:
            _push(
                handle, ("error", RequestError(f"the engine stopped: {why}", status=503, code=code))
            )
        for future in list(self._gauges.values()):
            future.get_loop().call_soon_threadsafe(_set_result, future, None)
        if self.failed and self.on_dead is not None:
            self.on_dead()


def _push(handle: Handle, item: tuple) -> None:
    try:
        handle.loop.call_soon_threadsafe(handle.queue.put_nowait, item)
    except RuntimeError:
        pass  # the event loop is closed: nobody is listening any more


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
