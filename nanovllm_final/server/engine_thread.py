"""One engine in one background thread, fed by a thread-safe command queue.

HTTP handlers run on the asyncio event loop; the engine runs on its own thread, which
builds the LLM (torch keeps some state per thread) and is the only thread that touches
it. Handlers send commands (add, abort, call) through a queue.SimpleQueue; between two
engine steps the thread applies every command that has arrived, so requests from many
HTTP connections join the running batch at the next step (continuous batching). Each
step's outputs go back to their handlers' asyncio queues with loop.call_soon_threadsafe.

The number of requests in flight is bounded (`max_pending`): past it, `submit` refuses
at once with a 503 instead of letting a queue grow without limit."""

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, Callable

from .metrics import ServerMetrics
from .protocol import RequestError

log = logging.getLogger("nanovllm.server")


class Handle:
    """One HTTP request: its engine requests, and the asyncio queue their outputs arrive on.

    Items on `queue`: ("accepted", None) once every prompt was added, then
    ("outputs", [RequestOutput, ...]) after each step that produced some, ("aborted", rid)
    when the server aborted one, or ("error", RequestError) if adding failed or the engine died."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prefix: str, num_prompts: int):
        self.loop = loop
        base = f"{prefix}-{uuid.uuid4().hex}"
        self.request_ids = [base] if num_prompts == 1 else [f"{base}-{i}" for i in range(num_prompts)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.created = time.time()
        self.start = time.perf_counter()

    def push(self, kind: str, payload: Any) -> None:
        """From the engine thread: hand an item to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more


class EngineThread:
    """The engine's thread and the loop-side API: submit, abort, call, stop."""

    def __init__(self, model: str, engine_options: dict, max_pending: int | None = None, metrics: ServerMetrics | None = None):
        """max_pending: requests in flight past which submit() refuses; None: 4 x max_num_seqs."""
        if max_pending is not None and (not isinstance(max_pending, int) or max_pending < 1):
            raise ValueError(f"max_pending must be a positive integer, got {max_pending!r}")
        self.model = model
        self.engine_options = engine_options
        self.max_pending = max_pending
        self.metrics = metrics or ServerMetrics()
        self.llm = None  # built by the engine thread
        self.error: str | None = None  # why the engine stopped, if it failed
        self.accepting = True
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0  # engine requests submitted and not yet finished
        self._live: dict[str, Handle] = {}  # engine thread only
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="nanovllm-engine", daemon=True)

    # ---- life cycle (main thread) ----

    def start(self) -> None:
        """Build the LLM on the engine thread; re-raise here whatever that raised."""
        self._thread.start()
        try:
            while not self._ready.wait(0.2):
                pass
        except KeyboardInterrupt:
            self.stop()
            raise
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is still running, shut the engine down (workers included), join the thread."""
        self.accepting = False
        self._commands.put(("stop",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and self._ready.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # ---- loop side ----

    def submit(self, prompts: list[list[int]], params, prefix: str) -> Handle:
        """Queue one HTTP request's prompts (all with the same SamplingParams)."""
        if not self.accepting:
            raise RequestError("the server is shutting down", status=503, code="shutting_down")
        if not self.alive:
            raise RequestError(f"the engine is not running: {self.error or 'stopped'}", status=503, code="engine_dead")
        if len(prompts) > self.max_pending:
            raise RequestError(f"a batch of {len(prompts)} prompts is more than the {self.max_pending} requests this server takes at once", "prompt")
        with self._lock:
            if self._in_flight + len(prompts) > self.max_pending:
                self.metrics.rejected("overload")
                raise RequestError(
                    f"the server is overloaded: {self._in_flight} requests in flight, at most {self.max_pending}; retry later",
                    status=503, code="overloaded",
                )
            self._in_flight += len(prompts)
        handle = Handle(asyncio.get_running_loop(), prefix, len(prompts))
        self._commands.put(("add", handle, prompts, params))
        return handle

    def abort(self, handle: Handle) -> None:
        """Abort the handle's unfinished requests at the next step (a client went away)."""
        self._commands.put(("abort", handle.request_ids))

    def abort_all(self) -> None:
        self._commands.put(("abort", None))

    async def call(self, fn: Callable[[Any], Any], timeout: float = 10.0) -> Any:
        """Run fn(llm) on the engine thread between two steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread has stopped")
        self._commands.put(("call", fn, future))
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    # ---- engine thread ----

    def _main(self) -> None:
        try:
            from .. import LLM

            self.llm = LLM(self.model, **self.engine_options)
            self.max_pending = self.max_pending or 4 * self.llm.config.max_num_seqs
        except BaseException as err:  # noqa: BLE001 - re-raised by start() on the main thread
            self._start_error = err
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001 - the engine is broken: fail every request, keep serving errors
            self.error = f"{type(err).__name__}: {err}"
            log.exception("the engine failed; refusing new requests")
            for rid, handle in list(self._live.items()):
                handle.push("error", RequestError(f"the engine failed: {self.error}", status=500, code="engine_error"))
            self._finish(list(self._live))
        finally:
            try:
                self.llm.shutdown()
            except Exception:  # noqa: BLE001 - shutting down after a failure: say it and go on
                log.exception("engine shutdown failed")

    def _loop(self) -> None:
        engine = self.llm.engine
        while True:
            # idle: block until a command comes; busy: take what arrived during the last step
            commands = [] if engine.has_unfinished_requests() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command[0] == "stop":
                    self._abort(None)
                    return
                self._apply(command)
            if engine.has_unfinished_requests():
                self._deliver(engine.step())

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, handle, prompts, params = command
            self._add(handle, prompts, params)
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            _, fn, future = command
            try:
                future.set_result(fn(self.llm))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                future.set_exception(err)

    def _add(self, handle: Handle, prompts: list[list[int]], params) -> None:
        engine = self.llm.engine
        added = []
        try:
            for rid, ids in zip(handle.request_ids, prompts):
                engine.add_request(ids, params, request_id=rid)
                self._live[rid] = handle
                added.append(rid)
                self.metrics.prompt(len(ids))
        except Exception as err:  # noqa: BLE001 - a bad request must not stop the engine
            for rid in added:
                engine.abort_request(rid)
            self._finish(added)
            with self._lock:
                self._in_flight -= len(prompts) - len(added)
            status = 400 if isinstance(err, ValueError) else 500
            handle.push("error", RequestError(str(err), status=status))
            return
        handle.push("accepted", None)

    def _abort(self, request_ids: list[str] | None) -> None:
        """Abort live requests (all of them if request_ids is None); their KV blocks are freed now."""
        engine = self.llm.engine
        rids = [rid for rid in (self._live if request_ids is None else request_ids) if rid in self._live]
        for rid in rids:
            engine.abort_request(rid)
            self._live[rid].push("aborted", rid)
            self.metrics.finished("abort")
        self._finish(rids)

    def _finish(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._live.pop(rid, None)
        with self._lock:
            self._in_flight -= len(request_ids)

    def _deliver(self, outputs: list) -> None:
        by_handle: dict[Handle, list] = defaultdict(list)
        done = []
        for out in outputs:
            handle = self._live.get(out.request_id)
            if handle is None:
                continue  # aborted by us already
            by_handle[handle].append(out)
            self.metrics.generated(sum(len(c.delta_token_ids) for c in out.outputs))
            if out.finished:
                done.append(out.request_id)
                self.metrics.observe_request(out, time.perf_counter() - handle.start)
        self._finish(done)
        if by_handle:  # one wake-up of the event loop per step, however many requests got tokens
            loop = next(iter(by_handle)).loop
            try:
                loop.call_soon_threadsafe(_put_outputs, list(by_handle.items()))
            except RuntimeError:
                pass  # the event loop is closed


def _put_outputs(items: list[tuple[Handle, list]]) -> None:
    for handle, outs in items:
        handle.queue.put_nowait(("outputs", outs))

