"""Tensor parallelism's processes: ranks 1..N-1 as workers, driven by rank 0. This module
is the one owner of the processes and their pipes; the model runner knows nothing of them.

Rank 0 is the user's process: it schedules and samples. Every other rank is a process
started with multiprocessing "spawn" (a fresh interpreter: CUDA cannot be forked) that
builds the same model runner on its own device and then waits for calls.

Driving. Each worker holds one end of a Pipe. Every step, `call("execute", runner.execute,
step)` on rank 0 sends the pickled ("execute", (step,)) down every pipe, runs the method
itself, then reads one reply per worker: ("ok", None) or ("error", traceback). `step` is a
StepInput: that step's input arrays (token ids, positions, slots, block tables: a few KB),
never a Sequence, whose token list grows with every step. Inside the method the ranks meet
in collectives (all-reduce, gather) that keep them in step. A Pipe carries a message of
any size and tells each side when the other is gone (EOF).

Failure. A worker that raises sends its traceback and exits at once. Rank 0 notices a dead
worker before a call (its exit code), while it waits for replies (it waits on the process
sentinel as well as the pipe), and inside a collective: gloo fails as soon as the peer's
socket closes; an NCCL kernel would wait for the dead peer until the timeout, so a
watchdog thread aborts the group the moment a worker's process ends (distributed.py
says why the CUDA graphs go first), which makes the waiting kernels return. Rank 0 then
stops the other workers and raises WorkerError: the engine cannot go on. A worker exits
when its pipe reaches EOF or its parent process ends (rank 0 is gone).

Cleanup. `shutdown()` asks every worker to leave. Each says goodbye, drops its CUDA
graphs and leaves the group; rank 0 leaves it with them (leaving waits for every rank).
A worker that does not say goodbye within SHUTDOWN_GRACE_S, or ranks out of step after an
error (a rank may be waiting in a collective that will never come), make rank 0 kill the
workers and abort the group instead. It is idempotent and also runs when the group is
garbage-collected and at interpreter exit (weakref.finalize); the processes are daemons
as a last resort."""

import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import torch

from ..config import EngineConfig, ModelConfig
from ..distributed import abort_tensor_parallel, destroy_tensor_parallel, require_no_process_group

SHUTDOWN_GRACE_S = (
    5.0  # how long a worker may take to say goodbye, then to leave, before it is killed
)
START_HINT = (
    "It died while starting. Workers are spawned: each one imports your main module again, so a "
    'script that creates a tensor-parallel LLM must do so under `if __name__ == "__main__":`.'
)


class WorkerError(RuntimeError):
    """A tensor-parallel worker died or failed; the engine cannot continue."""


def free_port(host: str, port: int) -> int:
    """`port` if it can be bound now, or with port 0 one the OS says is free (either could be
    taken before the rendezvous binds it; unlikely)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous server does
        s.bind((host, port))
        return s.getsockname()[1]


class WorkerGroup:
    """Rank 0's handle on the worker processes (ranks 1..N-1)."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner_class: type):
        """Start ranks 1..N-1; each builds `runner_class(config, model_config, rank)`."""
        require_no_process_group()  # one tensor-parallel engine per process
        try:
            config.distributed_port = free_port(config.distributed_host, config.distributed_port)
        except OSError as err:
            raise ValueError(
                f"cannot listen on {config.distributed_host}:{config.distributed_port} (distributed_host, distributed_port): {err}"
            ) from err
        self.timeout = config.distributed_timeout
        self.processes: list[mp.Process] = []
        self.conns: list[Connection] = []
        self.failure: str | None = None  # why the group was stopped, if it failed
        stop_reader, self._stop_writer = mp.Pipe(
            duplex=False
        )  # closing the writer ends the watchdog
        self._watchdogs: list[threading.Thread] = []
        self._aborted = threading.Event()  # the watchdog abandoned the group: a worker died
        self._out_of_step = threading.Event()  # a call failed: the ranks cannot leave together
        # registered before the first start, so a half-started group is cleaned up too
        self._finalizer = weakref.finalize(
            self,
            _stop,
            self.processes,
            self.conns,
            self._stop_writer,
            self._watchdogs,
            self._out_of_step,
        )
        ctx = mp.get_context("spawn")
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(runner_class, config, model_config, rank, theirs),
                name=f"tp-worker-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()  # only the worker holds its end: if it dies, our end sees EOF
            self.processes.append(proc)
            self.conns.append(ours)
        if config.device.startswith("cuda"):
            sentinels = [p.sentinel for p in self.processes]
            events = (self._aborted, self._out_of_step)
            self._watchdogs.append(
                threading.Thread(
                    target=_watchdog,
                    args=(sentinels, stop_reader, events),
                    name="tp-watchdog",
                    daemon=True,
                )
            )
            self._watchdogs[0].start()
        try:
            self.receive()  # each worker says hello once it has started, before it joins the group
        except WorkerError as err:
            raise WorkerError(f"{err}\n{START_HINT}") from err.__cause__

    @property
    def alive(self) -> bool:
        """False once the workers are stopped (after a failure, or shutdown)."""
        return self._finalizer.alive

    # ---- driving ----

    def call(self, method: str, local: Callable, *args):
        """Start `method(*args)` on every worker, run `local(*args)` (rank 0's part) here,
        then wait for the workers; returns rank 0's result."""
        return self.run_here(lambda: (self.send(method, *args), local(*args))[1])

    def run_here(self, fn: Callable, *args):
        """Run rank 0's part of a call, then wait for every worker's reply. If anything
        fails, the ranks are out of step: the workers are stopped (WorkerError if one of
        them failed or died, else rank 0's own error)."""
        try:
            result = fn(*args)
            self.receive()
        except BaseException as err:
            self.after_local_error(err)
            raise
        return result

    def send(self, method: str, *args) -> None:
        """Start `method(*args)` on every worker."""
        if not self.alive:
            raise WorkerError(
                f"the tensor-parallel workers were stopped earlier ({self.failure or 'shutdown'}); create a new LLM"
            )
        for rank, proc in enumerate(self.processes, 1):
            if proc.exitcode is not None:
                self.fail(self.death_note(rank))
        message = pickle.dumps((method, args))  # pickled once, sent to every worker
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send_bytes(message)
            except OSError as err:  # BrokenPipeError: the worker is gone
                self.fail(
                    self.find_failure(1.0)
                    or f"tensor-parallel worker rank {rank}: its pipe broke ({err})",
                    err,
                )

    def receive(self) -> None:
        """Wait for every worker's reply to the last call; raise WorkerError if one failed or died."""
        deadline = time.monotonic() + self.timeout
        for rank, (proc, conn) in enumerate(zip(self.processes, self.conns), 1):
            if not wait([conn, proc.sentinel], timeout=max(0.0, deadline - time.monotonic())):
                self.fail(
                    f"tensor-parallel worker rank {rank} (pid {proc.pid}) did not answer within {self.timeout:g} s"
                )
            try:
                status, payload = conn.recv()  # a reply, or EOF if it died without one
            except (EOFError, OSError):
                self.fail(self.death_note(rank))
            if status == "error":
                self.fail(f"tensor-parallel worker rank {rank} failed:\n{payload}")

    def after_local_error(self, err: BaseException) -> None:
        """Rank 0's part of a call raised. If a worker died or failed (a collective with a dead
        peer fails at once), raise WorkerError saying which. Either way the ranks are out of
        step now, so the workers are stopped; otherwise the caller re-raises `err`."""
        if not self.alive:
            return  # stopped already
        self._out_of_step.set()
        # our own input errors (every rank raises the same) and Ctrl-C need no diagnosis, unless
        # the watchdog aborted the group (then any collective raises, a ValueError among others)
        own = isinstance(err, (ValueError, KeyboardInterrupt)) and not self._aborted.is_set()
        note = None if own else self.find_failure(2.0)
        if note:
            self.fail(note, err)
        self.failure = f"rank 0 raised {type(err).__name__}: {err}"
        self.shutdown()

    def find_failure(self, wait_s: float) -> str | None:
        """Wait up to `wait_s` for a worker to report an error or die; describe the first that did."""
        ready = wait([*self.conns, *(p.sentinel for p in self.processes)], timeout=wait_s)
        for rank, (proc, conn) in enumerate(zip(self.processes, self.conns), 1):
            if conn in ready:
                try:
                    status, payload = conn.recv()
                    if status == "error":
                        return f"tensor-parallel worker rank {rank} failed:\n{payload}"
                except (EOFError, OSError):
                    pass  # it died without a word
            if proc.sentinel in ready or proc.exitcode is not None:
                return self.death_note(rank)
        return None

    def death_note(self, rank: int) -> str:
        proc = self.processes[rank - 1]
        proc.join(1.0)  # reap it, so the exit code is known
        code = proc.exitcode
        if code is None:
            how = "its pipe closed"
        elif code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
        else:
            how = f"exit code {code}"
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) died ({how})"

    def fail(self, message: str, cause: BaseException | None = None) -> NoReturn:
        """Stop every worker and raise WorkerError(message)."""
        self.failure = self.failure or message
        self._out_of_step.set()
        self.shutdown()
        raise WorkerError(f"{message}; the engine cannot continue: create a new LLM") from cause

    # ---- cleanup ----

    def shutdown(self) -> None:
        """Stop the workers and leave rank 0's process group; safe to call any number of times."""
        self._finalizer()


def _stop(
    processes: list[mp.Process],
    conns: list[Connection],
    stop_writer: Connection,
    watchdogs: list[threading.Thread],
    out_of_step: threading.Event,
) -> None:
    """The finalizer: no reference to the group, so that it can be garbage-collected."""
    stop_writer.close()  # first: a watchdog must not take the workers' exit for a death ...
    for thread in watchdogs:
        thread.join()  # ... and finishes an abort it has begun
    message = pickle.dumps(("shutdown", ()))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except (OSError, ValueError):
            pass  # it is gone already
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    if not out_of_step.is_set() and all(
        _says_goodbye(proc, conn, deadline) for proc, conn in zip(processes, conns)
    ):
        destroy_tensor_parallel()  # every rank leaves together (each waits for the others)
    else:  # a rank may wait for a peer that never comes: kill the workers, abandon the group
        for proc in processes:
            proc.kill()
            proc.join(2.0)
        abort_tensor_parallel()
        destroy_tensor_parallel()  # forgets the abandoned group
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.exitcode is None:
            proc.terminate()
            proc.join(2.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


def _says_goodbye(proc: mp.Process, conn: Connection, deadline: float) -> bool:
    """Wait until `deadline` for the worker's ("bye", None): it is about to leave the group.
    Replies to earlier calls that nobody read are skipped."""
    while wait([conn, proc.sentinel], timeout=max(0.0, deadline - time.monotonic())):
        try:
            if conn.recv()[0] == "bye":
                return True
        except (EOFError, OSError):
            return False  # it died
    return False


def _watchdog(
    sentinels: list[int], stop_reader: Connection, events: tuple[threading.Event, ...]
) -> None:
    """NCCL collectives wait for a dead peer until their timeout; abort them when a worker dies."""
    ready = wait([stop_reader, *sentinels])
    if stop_reader not in ready:
        for event in events:
            event.set()
        abort_tensor_parallel()


def _exit_with_parent() -> None:
    """A worker's thread: when rank 0's process ends, so does this one (it may be stuck in a
    collective that rank 0 will never join, and nothing else would ever end it)."""
    wait([mp.parent_process().sentinel])
    os._exit(1)


def worker_main(
    runner_class: type, config: EngineConfig, model_config: ModelConfig, rank: int, conn: Connection
) -> None:
    """A worker's whole life: build its model runner, then run the calls rank 0 sends until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0, which then stops us
    threading.Thread(target=_exit_with_parent, name="tp-parent-watch", daemon=True).start()
    if not config.device.startswith("cuda"):
        torch.set_num_threads(
            max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
        )  # share the cores
    try:
        conn.send(("ok", None))  # hello: started
        runner = runner_class(config, model_config, rank)
        conn.send(("ok", None))  # ready: weights and KV cache in place
        while True:
            try:
                method, args = pickle.loads(conn.recv_bytes())
            except EOFError:
                os._exit(0)  # rank 0 is gone, and with it the group
            if method == "shutdown":
                conn.send(("bye", None))  # rank 0 leaves the group once every worker has said this
                runner.shutdown()  # drops our CUDA graphs, then leaves the group with rank 0
                return
            getattr(runner, method)(*args)
            conn.send(("ok", None))
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)  # at once: leaving the group would wait for ranks that have moved on
