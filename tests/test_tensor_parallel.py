"""Tensor parallelism (stage 07 on), on CPU with gloo: sharded layers equal unsharded
ones, a TP=2 engine's greedy output equals TP=1 and Hugging Face, bad sizes are refused
before anything starts, a dead worker is reported within seconds, and no process outlives
its engine."""

import gc
import json
import multiprocessing
import os
import pathlib
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    ENGINES,
    ROOT,
    engine_module,
    generate_and_compare,
    level,
    load_engine,
    random_prompts,
    stage_view,
)

TP_ENGINES = [e for e in ENGINES if level(e) >= 7]

pytestmark = [
    pytest.mark.parametrize("engine", TP_ENGINES),
    pytest.mark.skipif(
        (os.cpu_count() or 1) < 2, reason="TP=2 on CPU needs two cores (one process per rank)"
    ),
    pytest.mark.xdist_group("processes"),  # under pytest-xdist: one after another, on one worker
]


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test must leave no worker process and no process group behind."""
    yield
    assert multiprocessing.active_children() == []
    assert not dist.is_initialized()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- layers, in two gloo processes


def load(layer, *tensors, shard_id=None) -> None:
    """Hand full (unsharded) checkpoint tensors to the layer's loaders, as the model loader does."""
    for param, tensor in zip((layer.weight, getattr(layer, "bias", None)), tensors):
        param.weight_loader(param, tensor, shard_id)


def check_layers_on_rank(rank: int, engine: str, port: int) -> None:
    parallel = engine_module(engine, "distributed")
    linear = engine_module(engine, "layers.linear")
    embedding = engine_module(engine, "layers.embedding")
    parallel.init_tensor_parallel(rank, 2, "gloo", f"tcp://127.0.0.1:{port}", 30.0)
    parallel.set_tp_rank(rank, 2)
    try:
        g = torch.Generator().manual_seed(0)  # the same full tensors on both ranks

        def randn(*shape):
            return torch.randn(*shape, generator=g)

        def mine(t, n):  # rank's block of n rows (of the last dim)
            return t[..., rank * n : (rank + 1) * n]

        x = randn(5, 8)  # (tokens, hidden)
        w1, b1, w2, b2 = randn(6, 8), randn(6), randn(4, 6), randn(4)
        col = linear.ColumnParallelLinear(8, 6, bias=True)
        load(col, w1, b1)
        assert col.weight.shape == (3, 8) and col.bias.shape == (3,)
        torch.testing.assert_close(col(x), mine(F.linear(x, w1, b1), 3))
        row = linear.RowParallelLinear(6, 4, bias=True)
        load(row, w2, b2)
        assert row.weight.shape == (4, 3) and row.bias.shape == (4,)
        torch.testing.assert_close(
            row(col(x)), F.linear(F.linear(x, w1, b1), w2, b2)
        )  # all-reduced

        gate, up = randn(6, 8), randn(6, 8)
        merged = linear.MergedColumnParallelLinear(8, [6, 6])
        load(merged, gate, shard_id=0)
        load(merged, up, shard_id=1)
        expected = torch.cat([mine(F.linear(x, gate), 3), mine(F.linear(x, up), 3)], dim=-1)
        torch.testing.assert_close(merged(x), expected)  # [gate of this rank | up of this rank]

        head_dim, heads, kv_heads = 2, 4, 2
        full = {
            s: (randn(n * head_dim, 8), randn(n * head_dim))
            for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))
        }
        qkv = linear.QKVParallelLinear(8, head_dim, heads, kv_heads, bias=True)
        for shard_id, tensors in full.items():
            load(qkv, *tensors, shard_id=shard_id)
        q, k, v = (F.linear(x, *full[s]) for s in "qkv")
        expected = torch.cat(
            [
                mine(q, heads // 2 * head_dim),
                mine(k, kv_heads // 2 * head_dim),
                mine(v, kv_heads // 2 * head_dim),
            ],
            -1,
        )
        torch.testing.assert_close(qkv(x), expected)  # whole heads: q heads 2r, 2r+1 with kv head r

        table = randn(10, 4)  # (vocab, hidden)
        emb = embedding.VocabParallelEmbedding(10, 4)
        load(emb, table)
        assert emb.weight.shape == (5, 4)
        ids = torch.tensor([9, 0, 4, 5, 3, 7])  # ids of both ranks' shards
        torch.testing.assert_close(emb(ids), F.embedding(ids, table))
        head = embedding.ParallelLMHead(10, 4)
        load(head, table)
        hidden = randn(3, 4)
        logits = head(hidden)
        if rank == 0:
            torch.testing.assert_close(logits, F.linear(hidden, table))  # gathered: (rows, vocab)
        else:
            assert logits is None
    finally:
        parallel.destroy_tensor_parallel()


def test_sharded_layers_equal_unsharded(engine):
    """Rank 0 runs in this process, rank 1 in a spawned one (one interpreter start, not two)."""
    port = free_port()
    peer = multiprocessing.get_context("spawn").Process(
        target=check_layers_on_rank, args=(1, engine, port)
    )
    peer.start()
    try:
        check_layers_on_rank(0, engine, port)
    finally:
        peer.join(timeout=60)  # if rank 0 failed, rank 1's next collective fails too: it exits
        if peer.is_alive():
            peer.kill()
            peer.join()
    assert peer.exitcode == 0, (
        f"rank 1 failed (exit code {peer.exitcode}); its traceback is on stderr"
    )


# ---------------------------------------------------------------- the engine


CASES = {
    # chunked prefill (16-token budget) and tiny blocks; the KV pool is sized automatically
    "qwen3": dict(max_model_len=128, kvcache_block_size=4, max_num_batched_tokens=16),
    # a KV pool too small for all sequences: preemption
    "llama": dict(max_model_len=48, kvcache_block_size=4, num_kvcache_blocks=12),
}


@pytest.mark.parametrize("model", list(CASES))
def test_tp2_matches_tp1_and_hf(engine, model, model_dir, hf_greedy):
    st, path = load_engine(engine), model_dir(model)
    prompts = (
        random_prompts([40, 3, 37, 21, 9], seed=70)
        if model == "qwen3"
        else random_prompts([10, 12, 8, 14, 9, 11], seed=20)
    )
    options = dict(device="cpu", **CASES[model])
    sampled = st.SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    with st.LLM(path, **options) as llm:
        ref_sampled = stage_view(llm.generate(prompts[:3], sampled, use_tqdm=False))
    with st.LLM(path, tensor_parallel_size=2, **options) as llm:
        assert len(multiprocessing.active_children()) == 1  # rank 1
        assert llm.engine.model_runner.kv_cache.shape[-2] == 1  # 2 KV heads, one per rank
        # rank 0 samples, with the same seeded sampler as TP=1
        assert stage_view(llm.generate(prompts[:3], sampled, use_tqdm=False)) == ref_sampled
        llm.stats.clear()
        generate_and_compare(st, llm, path, prompts, hf_greedy, max_tokens=24)
        if model == "qwen3":
            assert (
                max(s["num_tokens"] for s in llm.stats) <= 16
                and sum(s["chunked_prefills"] for s in llm.stats) > 0
            )
        else:
            assert sum(s["preemptions"] for s in llm.stats) > 0


def test_tp1_and_tp2_side_by_side(engine, model_dir):
    """TP=1 starts no process and no group, and can run beside a TP=2 engine; a second
    TP=2 engine in the same process is refused with a clear error."""
    st, path = load_engine(engine), model_dir("qwen3")
    prompts, params = (
        random_prompts([7, 19], seed=80),
        st.SamplingParams(temperature=0.0, max_tokens=8),
    )
    with st.LLM(path, device="cpu", max_model_len=64) as llm1:
        assert multiprocessing.active_children() == [] and not dist.is_initialized()
        expected = stage_view(llm1.generate(prompts, params, use_tqdm=False))
        with st.LLM(path, device="cpu", max_model_len=64, tensor_parallel_size=2) as llm2:
            with pytest.raises(RuntimeError, match="already initialised"):
                st.LLM(path, device="cpu", max_model_len=64, tensor_parallel_size=2)
            assert len(multiprocessing.active_children()) == 1  # the refused engine started nothing
            with st.LLM(
                path, device="cpu", max_model_len=64
            ) as llm1b:  # built while the group exists
                assert stage_view(llm1b.generate(prompts, params, use_tqdm=False)) == expected
            assert stage_view(llm2.generate(prompts, params, use_tqdm=False)) == expected
        assert stage_view(llm1.generate(prompts, params, use_tqdm=False)) == expected


def test_step_message_carries_only_the_step_inputs(engine, model_dir, monkeypatch):
    """Each step rank 0 sends every worker that step's input arrays, not the sequences: a
    decode step's message grows with the block table (4 bytes a block), not with the
    tokens generated so far. Besides arrays, a step may carry plain scalars (the final
    engine's max_seqlen_q, is_decode), which cannot grow."""
    st, path = load_engine(engine), model_dir("qwen3")
    group = engine_module(engine, "engine.workers").WorkerGroup
    messages = []
    real_send = group.send

    def send(self, method, *args):
        if method == "execute":
            (step,) = args
            # None: the final engine's `scoring`, when no prompt token is scored (prompt_logprobs)
            assert all(
                isinstance(value, (np.ndarray, int, float, type(None)))
                for value in vars(step).values()
            ), vars(step)
            messages.append(
                (len(step.input_ids), step.block_tables.shape, len(pickle.dumps((method, args))))
            )
        return real_send(self, method, *args)

    monkeypatch.setattr(group, "send", send)
    with st.LLM(
        path, device="cpu", max_model_len=512, kvcache_block_size=16, tensor_parallel_size=2
    ) as llm:
        out = llm.generate(
            [[5, 6, 7]],
            st.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
            use_tqdm=False,
        )
    assert len(out[0]["token_ids"]) == 300
    decode = [m for m in messages if m[0] == 1]  # one token fed
    assert len(decode) == 299
    (_, first_table, first_bytes), (_, last_table, last_bytes) = decode[0], decode[-1]
    assert first_table == (1, 1) and last_table == (1, 19)  # 4 and 302 tokens in the cache
    assert (
        last_bytes - first_bytes <= 4 * 18 + 16
    )  # the 18 new blocks (+ pickle framing), not 298 tokens


# ---------------------------------------------------------------- errors before anything starts


def edited_model(src: pathlib.Path, dst: pathlib.Path, **fields) -> pathlib.Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_key_value_heads=1), "num_key_value_heads=1"),
        (
            dict(num_attention_heads=3, num_key_value_heads=1),
            "num_attention_heads=3, num_key_value_heads=1",
        ),
        (dict(intermediate_size=129), "intermediate_size=129"),
        (dict(vocab_size=511), "vocab_size=511"),
    ],
)
def test_sizes_not_divisible(engine, model_dir, tmp_path, fields, message):
    st = load_engine(engine)
    path = edited_model(model_dir("qwen3"), tmp_path / "m", **fields)
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 must divide {message}"):
        st.LLM(path, device="cpu", tensor_parallel_size=2)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(tensor_parallel_size=(os.cpu_count() or 1) + 1), "one device per rank"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (dict(distributed_port=70000), "distributed_port"),
        (dict(distributed_port=-1), "distributed_port"),
        (dict(distributed_host=""), "distributed_host"),
        (dict(distributed_timeout=0), "distributed_timeout"),
    ],
)
def test_bad_parallel_options(engine, model_dir, options, message):
    st = load_engine(engine)
    with pytest.raises(ValueError, match=message):
        st.LLM(model_dir("qwen3"), device="cpu", **options)


def test_port_in_use(engine, model_dir):
    st = load_engine(engine)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            st.LLM(model_dir("qwen3"), device="cpu", tensor_parallel_size=2, distributed_port=port)


# ---------------------------------------------------------------- dead workers


def test_killed_worker_is_reported(engine, model_dir):
    st, path = load_engine(engine), model_dir("qwen3")
    params = st.SamplingParams(temperature=0.0, max_tokens=4)
    llm = st.LLM(path, device="cpu", max_model_len=64, tensor_parallel_size=2)
    try:
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"worker rank 1 \(pid \d+\) died \(killed by signal SIGKILL\)"
        ):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert time.monotonic() - start < 5
        assert multiprocessing.active_children() == []  # the group was stopped
        with pytest.raises(RuntimeError, match="stopped earlier"):
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
    finally:
        llm.shutdown()
        llm.shutdown()  # idempotent


def test_worker_killed_mid_generate(engine, model_dir):
    """The worker dies while rank 0 is inside a step's collectives: gloo fails, rank 0 says why."""
    st, path = load_engine(engine), model_dir("qwen3")
    with st.LLM(path, device="cpu", max_model_len=512, tensor_parallel_size=2) as llm:
        (worker,) = multiprocessing.active_children()
        killed_at = []

        def kill_after_some_steps():
            deadline = time.monotonic() + 30
            while len(llm.stats) < 10 and time.monotonic() < deadline:
                time.sleep(0.002)
            killed_at.append(time.monotonic())
            os.kill(worker.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_some_steps)
        killer.start()
        try:
            with pytest.raises(RuntimeError, match="worker rank 1 .* died"):
                llm.generate(
                    random_prompts([5] * 4, seed=90),
                    st.SamplingParams(max_tokens=500, ignore_eos=True),
                    use_tqdm=False,
                )
        finally:
            killer.join()
        assert time.monotonic() - killed_at[0] < 5


# ---------------------------------------------------------------- cleanup


def test_no_process_outlives_its_engine(engine, model_dir):
    st, path = load_engine(engine), model_dir("qwen3")
    with st.LLM(path, device="cpu", max_model_len=64, tensor_parallel_size=2) as llm:
        assert len(multiprocessing.active_children()) == 1 and dist.is_initialized()
        assert llm.config.distributed_port != 0  # the free port rank 0 picked
    assert multiprocessing.active_children() == [] and not dist.is_initialized()
    llm.shutdown()  # again: nothing happens

    port = free_port()  # a new group after the old one, at a port of our choosing
    llm = st.LLM(
        path, device="cpu", max_model_len=64, tensor_parallel_size=2, distributed_port=port
    )
    assert len(multiprocessing.active_children()) == 1 and llm.config.distributed_port == port
    del llm  # garbage collection stops the workers too
    gc.collect()


def running(pid: int) -> bool:
    stat = pathlib.Path(f"/proc/{pid}/stat")
    if stat.parent.parent.exists() and stat.parent.parent.joinpath("self").exists():
        return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_interpreter_exit_stops_workers(engine, model_dir):
    """A script that never calls shutdown(): its workers still end with it."""
    code = (
        "import importlib\n"
        f"st = importlib.import_module({load_engine(engine).__name__!r})\n"
        f"llm = st.LLM({str(model_dir('qwen3'))!r}, device='cpu', max_model_len=64, tensor_parallel_size=2)\n"
        "import multiprocessing\n"
        "print(multiprocessing.active_children()[0].pid, flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 5
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid)
