"""The engine core: the server's engine in a process of its own, stepping as fast as the
device goes; it never waits for the HTTP side (its messages go into a pipe buffer of 1 MiB
that the API process's reader thread drains, and no lock is shared with that process).

It reads commands from one pipe between steps (without waiting while it has work) and
writes one message per step to another: the step's deltas, a few ints per request.

    commands in:  ("add", key, [(request_id, prompt_token_ids, SamplingParams), ...])
                  ("abort", [request_id, ...] | None)   ("gauges", key)   ("stop",)
    messages out: ("ready", info) | ("failed", why)     once, after building the engine
                  ("step", replies, deltas)             replies: [("added", key, None | (message, param, code)),
                                                                  ("gauges", key, dict)]
                                                        deltas: [(request_id, [(index, ids, text, logprobs, reason)],
                                                                  metrics dict once finished, else None,
                                                                  prompt_logprobs once scored, else None)]
                  ("dead", why)                         the engine failed; the process then exits

Text is decoded once, where stop strings are matched: a request with stop strings is decoded
here (the engine must, to stop it) and its deltas carry the text; one without carries None,
and the API process decodes its token ids, off this process's critical path.

Each step is timed on a shared `Heartbeat` that a thread of this process also beats
(watchdog.py), so that the API process sees a hung engine.

The process exits when told to stop, when its command pipe closes (the API process is
gone), or after a failure; it shuts the engine down (tensor-parallel workers included)
on every way out."""

import signal
import traceback
from multiprocessing.connection import Connection

from ..validate import Problem
from .metrics import engine_gauges
from .watchdog import Heartbeat


def engine_core_main(
    commands: Connection,
    messages: Connection,
    model: str,
    engine_options: dict,
    heartbeat: Heartbeat | None = None,
) -> None:
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C is for the API process, which then stops us
    heartbeat = heartbeat or Heartbeat()
    heartbeat.start_beating()
    try:
        from .. import LLM

        llm = LLM(model, **engine_options)
    except BaseException as err:  # noqa: BLE001 - reported to the API process, which exits with it
        messages.send(
            ("failed", str(err) if isinstance(err, Problem) else f"{type(err).__name__}: {err}")
        )
        return
    signal.signal(
        signal.SIGTERM, signal.SIG_IGN
    )  # from now on we stop when told (or when our command pipe closes)
    try:
        messages.send(
            (
                "ready",
                {
                    "config": llm.config,
                    "model_config": llm.model_config,
                    "model_name": llm.model_name,
                    "tokenizer": llm.tokenizer.name_or_path,
                },
            )
        )
        EngineCore(llm, commands, messages, heartbeat).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the API process is gone
    except BaseException as err:  # noqa: BLE001 - the engine cannot go on: say why, then leave
        traceback.print_exc()
        try:
            messages.send(("dead", f"{type(err).__name__}: {err}"))
        except OSError:
            pass
    finally:
        llm.shutdown()


class EngineCore:
    def __init__(self, llm, commands: Connection, messages: Connection, heartbeat: Heartbeat):
        self.llm, self.engine, self.heartbeat = llm, llm.engine, heartbeat
        self.commands, self.messages = commands, messages
        self.live: set[str] = set()  # request ids added and not finished
        self.scored: set[str] = set()  # live requests whose prompt_logprobs were sent
        self.decoded: set[str] = set()  # live requests with stop strings: their text is sent

    def run(self) -> None:
        engine = self.engine
        while True:
            replies: list[tuple] = []
            # idle: block until a command comes; busy: take only what has arrived
            while self.commands.poll(
                None if not engine.has_unfinished_requests() and not replies else 0
            ):
                command = self.commands.recv()
                if command[0] == "stop":
                    return
                self.apply(command, replies)
            deltas = []
            if engine.has_unfinished_requests():
                self.heartbeat.step_started()
                deltas = self.deltas(engine.step())
                self.heartbeat.step_done()
            if replies or deltas:
                self.messages.send(("step", replies, deltas))

    def apply(self, command: tuple, replies: list[tuple]) -> None:
        kind = command[0]
        if kind == "add":
            _, key, items = command
            replies.append(("added", key, self.add(items)))
        elif kind == "abort":
            for rid in list(self.live) if command[1] is None else command[1]:
                if rid in self.live:
                    self.live.discard(rid)
                    self.decoded.discard(rid)
                    self.engine.abort_request(rid)
        elif kind == "gauges":
            replies.append(("gauges", command[1], engine_gauges(self.llm)))

    def add(self, items: list[tuple]) -> tuple | None:
        """Add one HTTP request's prompts, all or none; None, or why not (message, param, code)."""
        added = []
        try:
            for rid, ids, params in items:
                self.engine.add_request(ids, params, request_id=rid)
                added.append(rid)
        except (
            ValueError
        ) as err:  # the API side checked it already; the engine's own checks may know more
            for rid in added:
                self.engine.abort_request(rid)
            return (
                (err.message, err.param, err.code)
                if isinstance(err, Problem)
                else (str(err), None, "invalid_value")
            )
        self.live.update(added)
        self.decoded.update(rid for rid, _, params in items if params.stop)
        return None

    def deltas(self, outputs: list) -> list[tuple]:
        deltas = []
        for out in outputs:
            if out.request_id not in self.live:
                continue  # aborted by the API side: it has answered already
            decoded = out.request_id in self.decoded
            news = [
                (
                    c.index,
                    c.delta_token_ids,
                    c.delta_text if decoded else None,
                    c.delta_logprobs,
                    c.finish_reason,
                )
                for c in out.outputs
                if c.delta_token_ids or c.finish_reason
            ]
            scores = out.prompt_logprobs if out.request_id not in self.scored else None  # sent once
            if scores is not None:
                self.scored.add(out.request_id)
            if out.finished:
                self.live.discard(out.request_id)
                self.scored.discard(out.request_id)
                self.decoded.discard(out.request_id)
            deltas.append(
                (out.request_id, news, out.metrics.as_dict() if out.finished else None, scores)
            )
        return deltas
