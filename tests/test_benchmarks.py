"""The benchmark workloads and runner (CPU, tiny model, a few seconds each)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from common import ROOT

from benchmarks import run, workloads
from benchmarks.results import load_results, plot_throughput, table
from tools.tiny_model import make_model

VOCAB = 512


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("bench") / "tiny-qwen3", arch="qwen3", shape="tiny")


@pytest.fixture
def one_thread():
    """One torch thread: on a busy 2-core machine, 2 threads can make a tiny run 30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- workloads ----


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_workloads_are_deterministic_by_seed(name):
    small = {"num_seqs": 8}
    first = workloads.make_workload(name, VOCAB, **small)
    assert workloads.make_workload(name, VOCAB, **small) == first
    assert workloads.make_workload(name, VOCAB, seed=1, **small) != first


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_workloads_are_well_formed(name):
    prompts, params = workloads.make_workload(name, VOCAB)
    assert len(prompts) == len(params) == workloads.parameters(name)["num_seqs"]
    assert all(p and all(isinstance(t, int) and 0 <= t < VOCAB for t in p) for p in prompts)
    for sp in params:
        assert set(sp) == {"temperature", "max_tokens", "ignore_eos"}
        assert sp["ignore_eos"] is True and sp["temperature"] == 0.6 and sp["max_tokens"] >= 1


def test_nanovllm_bounds_and_scaling():
    prompts, params = workloads.nanovllm(151936)
    assert len(prompts) == 256
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p in prompts)
    assert all(100 <= sp["max_tokens"] <= 1024 for sp in params)
    prompts, params = workloads.nanovllm(VOCAB, num_seqs=4, max_input_len=50, max_output_len=20)
    assert len(prompts) == 4 and all(len(p) <= 50 and max(p) < VOCAB for p in prompts)
    assert all(sp["max_tokens"] <= 20 for sp in params)


def test_nanovllm_matches_nano_vllm_bench():
    """bench.py: seed(0), then every prompt (its length, then its ids), then every max_tokens."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    ours, params = workloads.nanovllm(151936)
    assert ours == prompts and [sp["max_tokens"] for sp in params] == max_tokens


def test_tiny_cpu_bounds():
    prompts, params = workloads.tiny_cpu(VOCAB)
    assert all(8 <= len(p) <= 48 for p in prompts)
    assert all(16 <= sp["max_tokens"] <= 48 for sp in params)


def test_shared_prefix_shares_its_prefix():
    prompts, params = workloads.shared_prefix(VOCAB)
    prefix = prompts[0][:64]
    assert all(p[:64] == prefix and 4 <= len(p) - 64 <= 16 for p in prompts)
    assert len({tuple(p) for p in prompts}) == len(prompts)
    assert all(sp["max_tokens"] == 16 for sp in params)


def test_long_prompts_mix():
    prompts, _ = workloads.long_prompts(VOCAB, num_seqs=20, num_long=3, max_input_len=500)
    lengths = [len(p) for p in prompts]
    assert lengths.count(500) == 3 and lengths[0] == 500
    assert all(16 <= n <= 128 for n in lengths if n != 500)


def test_unknown_workload_parameter_is_a_clear_error():
    with pytest.raises(ValueError, match="has no parameter"):
        workloads.make_workload("shared-prefix", VOCAB, max_input_len=10)
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.make_workload("nope", VOCAB)
    with pytest.raises(ValueError, match="num_seqs"):
        workloads.make_workload("tiny-cpu", VOCAB, num_seqs=0)


# ---- runner ----

EXPECTED_KEYS = {
    "engine",
    "stage",
    "device",
    "device_name",
    "model",
    "dtype",
    "workload",
    "num_seqs",
    "input_tokens",
    "output_tokens",
    "seconds",
    "output_tokens_per_s",
    "total_tokens_per_s",
    "engine_options",
    "peak_memory",
    "versions",
    "timestamp",
    "git_commit",
    "stats",
}


def test_runner_writes_a_record(tiny_model, tmp_path, capsys, one_thread):
    out = tmp_path / "results" / "tiny.json"
    argv = [
        "--engine",
        "02_kvcache",
        "--workload",
        "tiny-cpu",
        "--model",
        str(tiny_model),
        "--num-seqs",
        "6",
        "--device",
        "cpu",
        "--option",
        "max_num_seqs=8",
        "--out",
        str(out),
    ]
    assert run.main(argv) == 0
    record = json.loads(out.read_text())
    assert EXPECTED_KEYS <= set(record)
    assert record["engine"] == "02_kvcache" and record["stage"] == 2 and record["device"] == "cpu"
    assert (
        record["workload"]["name"] == "tiny-cpu" and record["workload"]["params"]["num_seqs"] == 6
    )
    assert record["num_seqs"] == 6 and record["input_tokens"] > 0
    assert record["output_tokens"] == record["requested_output_tokens"]  # ignore_eos
    assert record["seconds"] > 0 and record["output_tokens_per_s"] > 0
    assert record["total_tokens_per_s"] > record["output_tokens_per_s"]
    assert record["model"]["vocab_size"] == VOCAB and record["model"]["num_hidden_layers"] == 2
    assert record["engine_options"] == {"device": "cpu", "max_num_seqs": 8}
    assert record["torch_threads"] == 1
    assert set(record["versions"]) >= {"python", "torch", "triton", "transformers"}
    assert record["stats"]["num_steps"] > 0 and record["stats"]["max_seqs_per_step"] == 6
    assert "02_kvcache" in capsys.readouterr().out  # the table row

    loaded = load_results(directory=out.parent)
    assert [r["engine"] for r in loaded] == ["02_kvcache"] and loaded[0]["file"] == "tiny.json"
    assert "02_kvcache" in table(loaded)


def test_runner_runs_several_engines_into_a_list(tiny_model, tmp_path, one_thread):
    out = tmp_path / "two.json"
    argv = [
        "--engine",
        "01_naive",
        "--engine",
        "2",
        "--workload",
        "shared-prefix",
        "--model",
        str(tiny_model),
        "--num-seqs",
        "3",
        "--param",
        "prefix_len=16",
        "--param",
        "max_output_len=8",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    assert run.main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["engine"] for r in records] == ["01_naive", "02_kvcache"]
    assert records[0]["workload"]["params"]["prefix_len"] == 16
    assert all(r["output_tokens"] == 3 * 8 for r in records)


def test_runs_of_several_processes_join_into_one_file(
    tiny_model, tmp_path, one_thread, monkeypatch
):
    """The engine's NANOVLLM_* switches lead the recorded command; `benchmarks.results join`
    puts runs made apart into one list, in order, and refuses other JSON."""
    from benchmarks.results import join

    base = ["--engine", "3", "--workload", "shared-prefix", "--model", str(tiny_model)]
    base += ["--num-seqs", "2", "--param", "max_output_len=4", "--device", "cpu"]
    for flag in ("0", "1"):
        monkeypatch.setenv("NANOVLLM_FP8_DOT", flag)
        assert run.main([*base, "--out", str(tmp_path / f"{flag}.json")]) == 0
    join([str(tmp_path / "0.json"), str(tmp_path / "1.json")], str(tmp_path / "both.json"))
    records = json.loads((tmp_path / "both.json").read_text())
    assert [r["command"].split()[0] for r in records] == [
        "NANOVLLM_FP8_DOT=0",
        "NANOVLLM_FP8_DOT=1",
    ]
    (tmp_path / "other.json").write_text('{"benchmark": "kernels"}')
    with pytest.raises(SystemExit, match="benchmarks/run.py"):
        join([str(tmp_path / "other.json")], str(tmp_path / "no.json"))


def test_runner_usage_errors_exit_2(tiny_model, capsys):
    cases = {
        "unknown engine 'nope'": ["--engine", "nope", "--workload", "tiny-cpu"],
        "has no parameter": [
            "--engine",
            "02_kvcache",
            "--workload",
            "shared-prefix",
            "--max-input-len",
            "9",
        ],
        "max_model_len": [
            "--engine",
            "02_kvcache",
            "--workload",
            "nanovllm",
        ],  # 2048 > the tiny model's 1024
    }
    for message, argv in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            run.main([*argv, "--model", str(tiny_model), "--device", "cpu"])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_unknown_engine_from_the_command_line(tiny_model):
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--engine",
            "99_nope",
            "--workload",
            "tiny-cpu",
            "--model",
            str(tiny_model),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "unknown engine '99_nope'" in done.stderr and "02_kvcache" in done.stderr


def test_host_overhead_of_a_verify_step_accepts_every_proposal(one_thread):
    """The stubbed engines' verify steps each emit k + 1 tokens: with every proposal accepted, a
    request of m tokens takes m - 1 decode steps (its first comes from the prompt's step), or
    (m - 1) // (k + 1) full verify steps."""
    from benchmarks import host_overhead

    k = 4
    (params,) = host_overhead.nanovllm_workload(1, 64)[1]
    row = host_overhead.measure_verify(run.resolve_engine("final")[1], 1, 64, 256, k)
    assert row["decode_steps"] == params["max_tokens"] - 1
    assert row["verify_steps"] == (params["max_tokens"] - 1) // (k + 1) > 0


def test_verify_profile_profiles_each_kind_of_step(tiny_model, one_thread):
    """benchmarks/verify_profile.py's engines on the CPU (no graphs to replay): with every
    proposal accepted, a request of m tokens takes m - 1 decode steps, or (m - 1) // (k + 1) full
    verify steps; each kind's profile counts those steps and reports the host time before the
    first activity, which on the CPU is the whole step."""
    from benchmarks import verify_profile
    from nanovllm_final import SamplingParams

    k, m = 4, 21
    params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
    options = dict(device="cpu", max_num_seqs=1, overlap_scheduling=False, max_model_len=128)
    steps = verify_profile.compare(str(tiny_model), [[1, 5, 9, 13]], params, options, k, 1)
    decode, verify = steps["decode"], steps["verify"]
    assert decode["steps"] == m - 1 and verify["steps"] == (m - 1) // (k + 1) > 0
    assert decode["profile"]["summary"]["steps"] == m - 1
    assert verify["profile"]["summary"]["steps"] == (m - 1) // (k + 1)
    for kind in (decode, verify):
        summary = kind["profile"]["summary"]
        assert summary["mean_before_ms"] == summary["mean_wall_ms"] > 0
        assert summary["mean_gpu_ms"] == 0 and "replay_host_us" not in kind


def test_plot_throughput(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    base = {
        "workload": {"name": "tiny-cpu"},
        "device_name": "cpu",
        "model": {"shape": "tiny-qwen3"},
    }
    records = [
        base | {"engine": "01_naive", "output_tokens_per_s": 100.0},
        base | {"engine": "02_kvcache", "output_tokens_per_s": 300.0},
    ]
    ax = plot_throughput(records)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["01_naive", "02_kvcache"]
    assert [p.get_height() for p in ax.patches] == [100.0, 300.0]
    (tmp_path / "kernel_bench.json").write_text(
        json.dumps({"decode": []})
    )  # another schema: skipped
    assert load_results(directory=tmp_path) == []


# ---- recorded results: the index, the READMEs' tables, the GPU suite ----


def test_generated_tables_and_index_match_the_records():
    from benchmarks import tables

    stale = [
        str(path.relative_to(ROOT))
        for path, text in tables.outputs().items()
        if path.read_text(encoding="utf-8") != text
    ]
    assert not stale, f"out of date (run `python -m benchmarks.tables`): {stale}"
    assert tables.main(["--check"]) == 0


def test_a_table_differing_from_its_record_is_regenerated():
    from benchmarks import tables

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "<!-- table: ladder -->" in text and "<!-- table: final-h200 -->" in text
    record = tables.load("nanovllm_qwen3-0.6b_final_h200.json")
    true = f"{record['output_tokens_per_s']:,.0f}"
    assert true in text
    planted = text.replace(true, "99,999")  # a typed number
    assert planted != text and tables.fill(planted) == text
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        tables.fill("<!-- table: nope -->\n<!-- end table -->")


def test_index_names_every_file_and_its_command():
    from benchmarks import tables

    index = (ROOT / "benchmarks" / "results" / "README.md").read_text(encoding="utf-8")
    files = tables.result_files()
    assert files and all(f"[`{rel}`]({rel})" in index for rel in files)
    assert not [
        rel for rel in files if rel.endswith(".log") and "test" not in rel and "rows" not in rel
    ]  # logs are evidence only
    for rel in files:
        what, command = tables.describe(rel)
        assert what and command and "/tmp/" not in command and "/root/" not in command, rel
    names = " ".join(files)
    for word in (
        "round",
        "session",
        "call2",
        "before_overlap",
        "issue",
    ):  # named by what they measure
        assert word not in names


def test_index_refuses_a_file_it_cannot_describe(tmp_path, monkeypatch):
    from benchmarks import tables

    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    (tmp_path / "mystery.log").write_text("?")
    with pytest.raises(ValueError, match="mystery.log: no entry"):
        tables.index()


def test_clean_command():
    from benchmarks.tables import clean_command

    raw = "/opt/venv/bin/python3 -m benchmarks.run --engine 07 --out /tmp/x/ladder_07.json"
    assert clean_command(raw, "nanovllm_qwen3-0.6b_07_h200.json") == (
        "python -m benchmarks.run --engine 07 --out benchmarks/results/nanovllm_qwen3-0.6b_07_h200.json"
    )
    with_env = "NANOVLLM_FP8_DOT=1 /usr/bin/python3 -m benchmarks.run --out /tmp/a.json"
    assert clean_command(with_env, "a.json") == (
        "NANOVLLM_FP8_DOT=1 python -m benchmarks.run --out benchmarks/results/a.json"
    )


def test_gpu_suite_parts_match_the_index():
    import re

    script = ROOT / "benchmarks" / "gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    parts = {p for p in re.findall(r"^    ([a-z-]+)\)", text, re.M) if not p.startswith("-")}
    assert {"tests", "throughput", "tp", "serve", "latency"} <= parts
    index = (ROOT / "benchmarks" / "results" / "README.md").read_text(encoding="utf-8")
    named = {
        p
        for group in re.findall(r"gpu_suite\.sh ([a-z -]+)`", index)
        for p in group.split()
        if not p.startswith("-")
    }
    assert named and named <= parts, named - parts
    help_text = subprocess.run(
        ["bash", str(script), "--help"], capture_output=True, text=True
    ).stdout
    assert all(f"  {part} " in help_text for part in parts)
    for args in ([], ["no-such-part"], ["--bogus"]):
        assert subprocess.run(["bash", str(script), *args], capture_output=True).returncode == 2


def test_engine_block_tables_place_blocks_as_the_block_manager_does():
    """decode_tiles_bench's engine layout: each running request's table covers its context and no
    block is shared; a prompt's blocks are one run, prompts in arrival order; the blocks decode
    adds come after every prompt's, in the order they were handed out."""
    from benchmarks.decode_attention_bench import BLOCK, engine_block_tables, snapshot
    from nanovllm_final.engine.block_manager import blocks_needed
    from nanovllm_final.workloads import nanovllm

    for step in (1, 300, 1000):
        tables = engine_block_tables(step)
        assert [len(t) for t in tables] == [blocks_needed(c, BLOCK) for c in snapshot(step)]
        ids = [b for t in tables for b in t]
        assert len(ids) == len(set(ids))
    prompts, params = nanovllm(151936, seed=0)
    prompt_blocks = sum(blocks_needed(len(p), BLOCK) for p in prompts)
    running = [p for p, sp in zip(prompts, params) if sp["max_tokens"] > 300]
    tables = engine_block_tables(300)
    for p, t in zip(running, tables):
        n = blocks_needed(len(p), BLOCK)
        assert t[:n] == list(range(t[0], t[0] + n))
        assert all(b >= prompt_blocks for b in t[n:]) and t[n:] == sorted(t[n:])
    assert [t[0] for t in tables] == sorted(t[0] for t in tables)


def two_request_record() -> tuple[dict, list[int], list[int]]:
    """A run.py record of a two-request workload on a tiny model (3 layers, 2 kv heads of 8, 1000
    parameters), with its prompt and output lengths."""
    from nanovllm_final.workloads import make_workload

    params = {
        "num_seqs": 2,
        "max_input_len": 8,
        "max_output_len": 6,
        "min_input_len": 4,
        "min_output_len": 3,
        "seed": 1,
    }
    prompts, sampling = make_workload("tiny-cpu", 64, **params)
    ins, outs = [len(p) for p in prompts], [s["max_tokens"] for s in sampling]
    model = {
        "vocab_size": 64,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "dtype": "bfloat16",
        "num_parameters": 1000,
        "model_type": "llama",
    }
    record = {
        "model": model,
        "workload": {"name": "tiny-cpu", "params": params},
        "engine_options": {},
    }
    return record, ins, outs


def test_workload_limit_counts_what_the_workload_must_move():
    """benchmarks/limits.py on a two-request workload computed by hand: each decode step t reads
    the in + t cached tokens of the requests still running and the weights once, or does their
    GEMM FLOPs where those take longer; prefill FLOPs on top. An fp8 cache halves the KV time,
    and the share is what run.py prints."""
    from benchmarks.limits import workload_limit

    record, ins, outs = two_request_record()
    per_token = 2 * 3 * 2 * 8 * 2
    steps = [[i + t for i, o in zip(ins, outs) if o > t] for t in range(1, max(outs))]
    limit = workload_limit(record, bandwidth=1e6, peak_flops=1e9)
    assert limit["kv_s"] == pytest.approx(sum(sum(live) for live in steps) * per_token / 1e6)
    assert limit["weights_s"] == pytest.approx(
        1000 * 2 * len(steps) / 1e6
    )  # 2 us of FLOPs a sequence: bytes bound
    assert limit["gemm_bound_steps"] == 0 and limit["decode_steps"] == len(steps)
    assert limit["prefill_s"] == pytest.approx(2 * 1000 * sum(ins) / 1e9)
    total = limit["kv_s"] + limit["weights_s"] + limit["prefill_s"]
    assert limit["output_tokens_per_s"] == pytest.approx(sum(outs) / total)
    slow = workload_limit(
        record, bandwidth=1e6, peak_flops=1e6
    )  # 2 ms of FLOPs a sequence: two are GEMM bound
    assert slow["weights_s"] == pytest.approx(sum(max(2e-3, 2e-3 * len(live)) for live in steps))
    assert slow["gemm_bound_steps"] == sum(len(live) > 1 for live in steps) > 0
    record["engine_options"] = {"kv_cache_dtype": "fp8"}
    assert workload_limit(record, bandwidth=1e6, peak_flops=1e9)["kv_s"] == pytest.approx(
        limit["kv_s"] / 2
    )


def test_workload_limit_takes_the_devices_own_peaks():
    """A record's measured device_peaks win; a record without them takes KNOWN_PEAKS by device
    name; a device in neither is a clear error, not a limit computed with another card's numbers."""
    from benchmarks.limits import KNOWN_PEAKS, workload_limit

    record, _, _ = two_request_record()
    record["device_name"] = "NVIDIA H200"
    assert workload_limit(record)["bandwidth"] == KNOWN_PEAKS["NVIDIA H200"]["bandwidth"]
    record["device_peaks"] = {"bandwidth": 1e6, "peak_flops": 1e9}
    assert workload_limit(record) == workload_limit(record, bandwidth=1e6, peak_flops=1e9)
    del record["device_peaks"]
    record["device_name"] = "Some Future GPU"
    with pytest.raises(ValueError, match="Some Future GPU"):
        workload_limit(record)


def test_decode_step_limits_are_the_steps_of_the_workload():
    """decode_step_limits on the same two requests, by hand: step t runs the requests with more
    than t output tokens, reading their in + t cached tokens and the weights once."""
    from benchmarks.limits import decode_step_limits

    record, ins, outs = two_request_record()
    steps = decode_step_limits(record, bandwidth=1e6, peak_flops=1e9)
    assert len(steps) == max(outs) - 1
    for t, (batch, seconds) in enumerate(steps, start=1):
        live = [i + t for i, o in zip(ins, outs) if o > t]
        assert batch == len(live)
        assert seconds == pytest.approx((sum(live) * 2 * 3 * 2 * 8 * 2 + 1000 * 2) / 1e6)


def test_final_table_of_a_device_without_records_says_so():
    """A device's final table holds only the rows whose records it has; none: a line saying so."""
    from benchmarks import tables

    assert "nanovllm_qwen3-0.6b_final_h200.json" in tables.final_table("", "h200")
    empty = tables.final_table("", "no-such-device")
    assert "No records" in empty and "|" not in empty
