"""A watchdog for the engine core: a hung engine becomes a 503 and an exit, never silence.

The engine core writes two clocks into shared memory (`Heartbeat`, time.monotonic(), which
is one clock for every process of the machine):

- `beat`: a thread of the engine core writes it every BEAT_S, whatever the main thread does.
  It stops only when the whole process stops: SIGSTOP, a freeze, a C call that holds the GIL
  forever. A step that is merely long (a large prefill, kernels compiled on first use) keeps it
  fresh.
- `step`: when the step now running began (0 between steps), written by the main thread. A
  step that never returns (a deadlock in a collective, a hung device: the GIL released, so
  the beat thread lives on) shows here.

The API process's `Watchdog` thread looks twice a second. While the engine has work (some
request in flight), it trips when the beat is older than `timeout_s`, or when one step has
run for longer than `timeout_s` (the engine's first steps, which may compile kernels, get
FIRST_STEPS_ALLOWANCE times as long; CUDA graphs are captured before the server starts
serving, so their capture is never watched). Tripping answers every waiting request with a
503 (`engine_hung`), turns /health to 503, kills the engine process, and makes the server
exit with code 1, for a supervisor to restart it. An idle engine is not watched: a stopped
engine with nothing to do harms nobody, and the first request it gets trips it at once.
"""

import multiprocessing as mp
import threading
import time
from typing import Callable

BEAT_S = 0.5
CHECK_S = 0.5
FIRST_STEPS, FIRST_STEPS_ALLOWANCE = 3, 10


class Heartbeat:
    """Shared clocks: [beat, start of the running step (0: none), steps done]."""

    def __init__(self, ctx=mp):
        self.values = ctx.RawArray("d", 3)
        self.values[0] = time.monotonic()

    def start_beating(self) -> None:
        """In the engine core: a daemon thread that beats while the process runs."""

        def beat() -> None:
            while True:
                self.values[0] = time.monotonic()
                time.sleep(BEAT_S)

        threading.Thread(target=beat, name="nanovllm-heartbeat", daemon=True).start()

    def step_started(self) -> None:
        self.values[1] = time.monotonic()

    def step_done(self) -> None:
        self.values[1] = 0.0
        self.values[2] += 1

    def silence(self, timeout_s: float) -> str | None:
        """Why the engine looks hung, or None."""
        now, (beat, step, steps) = time.monotonic(), self.values[:]
        if now - beat > timeout_s:
            return f"the engine process gave no sign of life for {now - beat:.0f} s (watchdog limit {timeout_s:g} s)"
        limit = timeout_s * (FIRST_STEPS_ALLOWANCE if steps < FIRST_STEPS else 1)
        if step and now - step > limit:
            return f"one engine step has run for {now - step:.0f} s (watchdog limit {limit:g} s)"
        return None


class Watchdog:
    """In the API process: calls `trip(why)` once, when `busy()` and the heartbeat says hung."""

    def __init__(
        self,
        heartbeat: Heartbeat,
        timeout_s: float,
        busy: Callable[[], bool],
        trip: Callable[[str], None],
    ):
        self.heartbeat, self.timeout_s, self.busy, self.trip = heartbeat, timeout_s, busy, trip
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="nanovllm-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopped.wait(CHECK_S):
            why = self.heartbeat.silence(self.timeout_s) if self.busy() else None
            if why is not None:
                self.trip(why)
                return
