"""Tensor-parallel scenarios on two CUDA GPUs (NCCL), each run in its own interpreter by
tests/test_gpu_tp.py, so that a hang costs one scenario, not the whole test session.
ENGINE is 07_tensor_parallel or final; outputs are compared through `stage_view`.

    python tests/tp_gpu_scenarios.py SCENARIO ENGINE MODEL_DIR

Prints one line `RESULT {json}` with what it measured, and exits 0 when every check
passed (an AssertionError otherwise). Workers are spawned: everything runs under
`if __name__ == "__main__":`."""

import json
import multiprocessing
import os
import pathlib
import signal
import sys
import threading
import time

sys.path[:0] = [
    str(pathlib.Path(__file__).resolve().parent),
    str(pathlib.Path(__file__).resolve().parents[1]),
]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import engine_module, load_engine, random_prompts, stage_view  # noqa: E402

OPTIONS = dict(device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=8)
GRACEFUL_S = 5.0  # a shutdown must be done well within this (the workers' grace period is 5 s)


def no_leftovers() -> None:
    assert multiprocessing.active_children() == [], multiprocessing.active_children()
    assert not dist.is_initialized()


def timed_shutdown(llm) -> float:
    start = time.monotonic()
    llm.shutdown()
    return time.monotonic() - start


def equal(st, path: str) -> dict:
    """Greedy tokens of TP=2 equal TP=1's in float32, eager and with CUDA graphs; each TP=2
    engine shuts down within seconds (with a `with` block)."""
    prompts = random_prompts([40, 3, 37, 21, 9, 30, 17, 5], seed=70)
    params = st.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with st.LLM(path, enforce_eager=True, **OPTIONS) as llm:
        expected = stage_view(llm.generate(prompts, params, use_tqdm=False))
    result = {}
    for name, eager in (("eager", True), ("graphs", False)):
        llm = st.LLM(path, tensor_parallel_size=2, enforce_eager=eager, **OPTIONS)
        with llm:
            assert len(multiprocessing.active_children()) == 1
            got = stage_view(llm.generate(prompts, params, use_tqdm=False))
            replays = llm.engine.model_runner.num_graph_replays
            start = time.monotonic()
        result[f"{name}_with_exit_s"] = time.monotonic() - start
        no_leftovers()
        assert got == expected, f"TP=2 ({name}) differs from TP=1"
        assert (replays > 0) == (not eager), replays
        result[f"{name}_graph_replays"] = replays
        assert result[f"{name}_with_exit_s"] < GRACEFUL_S
    return result


def shutdown(st, path: str) -> dict:
    """shutdown() after CUDA graphs returns within seconds, twice in one process, and a new
    TP=2 engine works after each."""
    prompts = random_prompts([12, 7, 30], seed=5)
    params = st.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    result, outputs = {}, []
    for i in range(2):
        llm = st.LLM(path, tensor_parallel_size=2, **OPTIONS)
        outputs.append(stage_view(llm.generate(prompts, params, use_tqdm=False)))
        assert llm.engine.model_runner.num_graph_replays > 0
        result[f"shutdown_{i}_s"] = timed_shutdown(llm)
        no_leftovers()
        assert result[f"shutdown_{i}_s"] < GRACEFUL_S
        assert timed_shutdown(llm) < 0.5  # idempotent
    assert outputs[0] == outputs[1]
    return result


def exit_without_shutdown(st, path: str) -> dict:
    """A script that never calls shutdown(): the caller times how long the interpreter takes
    to exit after the line READY and checks that the worker is gone."""
    llm = st.LLM(path, tensor_parallel_size=2, **OPTIONS)
    llm.generate(
        random_prompts([12, 7], seed=6),
        st.SamplingParams(temperature=0.0, max_tokens=16),
        use_tqdm=False,
    )
    assert llm.engine.model_runner.num_graph_replays > 0
    (worker,) = multiprocessing.active_children()
    print(f"READY {worker.pid}", flush=True)
    return {"worker_pid": worker.pid}


def kill_after(llm, pid: int, replays: int, killed_at: list) -> threading.Thread:
    """SIGKILL `pid` once rank 0 has replayed `replays` graphs or, eager, run 20 steps."""
    runner = llm.engine.model_runner

    def kill() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
            runner.num_graph_replays < replays if replays else len(llm.stats) < 20
        ):
            time.sleep(0.0005)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def kill(st, path: str) -> dict:
    """A worker SIGKILLed mid-generate (eager; and during CUDA graph replays) makes rank 0
    raise WorkerError within 5 s and leaves no process behind; a new TP=2 engine then works."""
    prompts = random_prompts([5] * 8, seed=90)
    long = st.SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    result = {}
    for name, eager in (("eager", True), ("graphs", False)):
        llm = st.LLM(path, tensor_parallel_size=2, enforce_eager=eager, **OPTIONS)
        (worker,) = multiprocessing.active_children()
        killed_at = []
        killer = kill_after(llm, worker.pid, 0 if eager else 50, killed_at)
        try:
            llm.generate(prompts, long, use_tqdm=False)
            raise AssertionError("generate did not fail")
        except RuntimeError as err:
            raised_at = time.monotonic()
            assert "worker rank 1" in str(err) and "SIGKILL" in str(err), str(err)
            assert type(err).__name__ == "WorkerError", repr(err)
        finally:
            killer.join()
        result[f"{name}_raised_after_s"] = raised_at - killed_at[0]
        result[f"{name}_graph_replays"] = llm.engine.model_runner.num_graph_replays
        result[f"{name}_shutdown_s"] = timed_shutdown(llm)
        no_leftovers()
        assert result[f"{name}_raised_after_s"] < 5, result
        assert result[f"{name}_shutdown_s"] < GRACEFUL_S, result
    assert result["graphs_graph_replays"] >= 50
    # the abandoned group left this process clean: a new TP=2 engine works and shuts down
    prompts = random_prompts([12, 7, 30], seed=5)
    params = st.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with st.LLM(path, enforce_eager=True, **OPTIONS) as llm:
        expected = stage_view(llm.generate(prompts, params, use_tqdm=False))
    llm = st.LLM(path, tensor_parallel_size=2, **OPTIONS)
    assert stage_view(llm.generate(prompts, params, use_tqdm=False)) == expected
    result["after_shutdown_s"] = timed_shutdown(llm)
    no_leftovers()
    return result


def worker_raises(st, path: str) -> dict:
    """A worker that raises while rank 0 waits for it in a collective: rank 0 gets the
    worker's traceback within 5 s, and no process is left behind."""
    llm = st.LLM(path, tensor_parallel_size=2, **OPTIONS)
    parallel = engine_module(ENGINE, "distributed")
    workers = llm.engine.workers
    start = time.monotonic()
    try:
        workers.send("no_such_method")  # raises AttributeError on the worker ...
        try:
            parallel.min_over_ranks(
                1, torch.device("cuda", 0)
            )  # ... while rank 0 waits in an all-reduce
            workers.receive()
        except BaseException as err:
            workers.after_local_error(err)
            raise
        raise AssertionError("no error")
    except RuntimeError as err:
        elapsed = time.monotonic() - start
        assert type(err).__name__ == "WorkerError", repr(err)
        assert "AttributeError" in str(err) and "no_such_method" in str(err), str(err)
    result = {"raised_after_s": elapsed, "shutdown_s": timed_shutdown(llm)}
    no_leftovers()
    assert elapsed < 5, result
    return result


SCENARIOS = {
    "equal": equal,
    "shutdown": shutdown,
    "exit": exit_without_shutdown,
    "kill": kill,
    "raise": worker_raises,
}

if __name__ == "__main__":
    scenario, ENGINE, model_dir = sys.argv[1:4]
    result = SCENARIOS[scenario](load_engine(ENGINE), model_dir)
    print("RESULT " + json.dumps({"scenario": scenario, "engine": ENGINE, **result}), flush=True)
