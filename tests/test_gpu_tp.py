"""Tensor parallelism on two CUDA GPUs with NCCL (skipped without two GPUs): greedy TP=2
equals TP=1 in float32, eager and with CUDA graphs; shutdown after CUDA graphs returns
within seconds (shutdown(), `with`, interpreter exit); a worker that is SIGKILLed (also
during graph replays) or raises is reported within 5 s with no process left behind.

Each scenario runs in its own interpreter (tests/tp_gpu_scenarios.py) under a time limit:
a hang fails one test, with every process's Python stack (faulthandler on SIGABRT)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from common import ENGINES, ROOT, level

TP_ENGINES = [e for e in ENGINES if level(e) >= 7]
SCRIPT = pathlib.Path(__file__).resolve().parent / "tp_gpu_scenarios.py"
LIMIT_S = 90  # per scenario; each builds a few tiny engines (seconds each)

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.parametrize("engine", TP_ENGINES),
]


def start(scenario: str, engine: str, model: pathlib.Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONFAULTHANDLER": "1",
        "NCCL_NVLS_ENABLE": "0",
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), scenario, engine, str(model)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, limit: float = LIMIT_S) -> str:
    """Wait for the scenario; on a hang, make every process of it print its stack, then kill them."""
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # faulthandler prints each process's Python stack
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"hung for {limit} s:\n{out[-20000:]}")
    assert proc.returncode == 0, out[-20000:]
    return out


def run(scenario: str, engine: str, model: pathlib.Path) -> dict:
    out = finish(start(scenario, engine, model))
    print(out)  # measurements end up in the log (pytest -s)
    result = json.loads(
        next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT ") :]
    )
    return result


def test_tp2_equals_tp1_eager_and_graphs(engine, model_dir):
    result = run("equal", engine, model_dir("qwen3"))
    assert result["graphs_graph_replays"] > 0


def test_shutdown_after_graphs_returns(engine, model_dir):
    result = run("shutdown", engine, model_dir("qwen3"))
    assert max(result["shutdown_0_s"], result["shutdown_1_s"]) < 5


def test_interpreter_exit_after_graphs(engine, model_dir):
    proc = start("exit", engine, model_dir("qwen3"))
    pid, lines = None, []
    for line in proc.stdout:  # the script prints READY <worker pid>, then its interpreter exits
        lines.append(line)
        if line.startswith("READY "):
            pid, ready_at = int(line.split()[1]), time.monotonic()
            break
    assert pid is not None, "".join(lines)
    out = finish(proc)
    exit_s = time.monotonic() - ready_at
    print("".join(lines) + out + f"\ninterpreter exit took {exit_s:.2f} s")
    assert exit_s < 5
    assert (
        not pathlib.Path(f"/proc/{pid}").exists()
        or "zombie" in pathlib.Path(f"/proc/{pid}/status").read_text()
    )


def test_killed_worker_reported_within_5s(engine, model_dir):
    result = run("kill", engine, model_dir("qwen3"))
    assert result["eager_raised_after_s"] < 5 and result["graphs_raised_after_s"] < 5


def test_worker_exception_reported_within_5s(engine, model_dir):
    result = run("raise", engine, model_dir("qwen3"))
    assert result["raised_after_s"] < 5
