"""The kernels' tuning owner (nanovllm_final/kernels/tuning.py) and the command that writes its
files (python -m nanovllm_final.tune, here in its CPU dry run under the Triton interpreter)."""

import argparse
import dataclasses
import json
import logging
import os
import time

import pytest
import torch

from nanovllm_final.kernels import tuning

A100 = dict(sms=108, shared_memory=163 * 1024, capability=(8, 0), l2=40 * 2**20)


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    """The file a device takes, whatever the shell's NANOVLLM_KERNEL_CONFIG names."""
    monkeypatch.delenv(tuning.ENV, raising=False)


def h200_config() -> dict:
    return json.loads((tuning.CONFIG_DIR / "NVIDIA_H200.json").read_text())


def records(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if name in r.getMessage()]


def test_shipped_files_are_valid_and_named_for_their_device():
    files = sorted(tuning.CONFIG_DIR.glob("*.json"))
    assert files
    for path in files:
        config = tuning.load(path)
        assert tuning.file_name(config["device"]) == path.name


def test_a_device_with_a_file_uses_it_and_says_so_once(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="nanovllm_final")
    config = h200_config()
    config["gemv"]["down"]["rows"] = 5
    config["decode_attention"]["bf16"]["128"]["BLOCK_N"] = 32
    (tmp_path / "Test_GPU_with_file.json").write_text(json.dumps(config))
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    dev = tuning.Device("Test GPU (with file)", **A100)
    for _ in range(2):
        choice = tuning.choose(dev)
    assert choice.few_rows("down") == 5 and choice.decode(False, 128)["BLOCK_N"] == 32
    assert choice.decode(False, 64)["BLOCK_N"] == 128  # a head_dim up to 64: the "64" entry
    assert choice.decode(False, 256)["BLOCK_N"] == 32  # past the largest key: the largest
    expected = f"kernel tuning for Test GPU (with file): file {tmp_path}/Test_GPU_with_file.json"
    assert records(caplog, "Test GPU (with file)") == [expected]


def test_an_unknown_device_takes_the_rules_and_says_so_once(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="nanovllm_final")
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    big = tuning.choose(tuning.Device("Test GPU unknown", **A100))
    tuning.choose(tuning.Device("Test GPU unknown", **A100))
    (line,) = records(caplog, "Test GPU unknown")
    assert (
        "no file Test_GPU_unknown.json, rules from 108 SMs, 163 KiB shared memory" in line
        and "40 MiB L2" in line
    )
    small = tuning.choose(tuning.Device("Test GPU small", **{**A100, "shared_memory": 99 * 1024}))
    assert big.decode(False, 128)["num_stages"] == 3 and small.decode(False, 128)["num_stages"] == 2
    assert small.moe_grouped(100)["num_stages"] == 2  # less shared memory: fewer stages in flight


def test_the_cpu_rules_are_small_valid_tiles():
    choice = tuning.for_device(torch.device("cpu"))
    assert choice.source == "rules for a CPU"
    assert choice.decode(True, 128)["BLOCK_N"] <= 32 and choice.prefill(128)["BLOCK_M"] <= 32
    assert all(choice.gemv(kind)["loop"]["BLOCK_K"] <= 32 for kind in tuning.GEMV_KINDS)


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda c: c["gemv"]["down"].pop("rows"), "gemv.down lacks 'rows'"),
        (
            lambda c: c["decode_attention"]["fp8"]["128"].update(BLOCK_N="64"),
            "decode_attention.fp8.128.BLOCK_N must be",
        ),
        (lambda c: c["moe"]["grouped"].update(big={}), "moe.grouped must map sizes"),
        (lambda c: c.pop("prefill_attention"), "the top level lacks 'prefill_attention'"),
        (  # optional, checked where present
            lambda c: c["gemv"]["linear"]["dot"].update(SPLIT_K="auto"),
            "gemv.linear.dot.SPLIT_K must be",
        ),
    ],
)
def test_a_malformed_file_is_a_clear_error(tmp_path, damage, message):
    config = h200_config()
    damage(config)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"kernel config {path}: .*{message}"):
        tuning.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        tuning.load(path)


def test_the_environment_names_another_file(tmp_path, monkeypatch):
    config = h200_config()
    config["moe"]["small_pairs"] = 7
    (tmp_path / "other.json").write_text(json.dumps(config))
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "other.json"))
    assert tuning.choose(tuning.Device("Test GPU env", **A100)).moe_small_pairs == 7


def test_override_replaces_choices_within_its_block():
    cpu = torch.device("cpu")
    before = tuning.for_device(cpu).few_rows("linear")
    with tuning.override({"gemv": {"linear": {"rows": before + 3}}}):
        assert tuning.for_device(cpu).few_rows("linear") == before + 3
        assert tuning.for_device(cpu).gemv("down") == tuning._for("cpu", None).gemv("down")
    assert tuning.for_device(cpu).few_rows("linear") == before


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the CPU's check of the command (on a GPU, tune itself runs: "
    "benchmarks/gpu_suite.sh tune); the GPU machine's older Triton interprets the decode kernel differently",
)
def test_tune_dry_run_writes_a_file_the_tuning_reads(tmp_path):
    """The command's CPU mode: tiny shapes, two candidates each, every section timed; the file
    it writes is valid, records its timings, and its choices are candidates it timed."""
    from nanovllm_final import tune

    out = tmp_path / "cpu.json"
    tune.run(argparse.Namespace(dry_run=True, out=out, reps=1, only=None))
    config = tuning.load(out)
    plan = tune.DRY_PLAN
    assert config["device"] == "cpu" and config["record"]["measured_ms"]
    decode = config["decode_attention"]["bf16"]["32"]
    assert (decode["BLOCK_N"], decode["num_warps"], decode["num_stages"]) in plan.decode_tiles
    assert tuple(config["prefill_attention"]["32"].values()) in plan.prefill_tiles
    assert tuple(config["moe"]["gemv"].values()) in plan.moe_gemv_tiles
    assert set(config["moe"]["grouped"]) == set(plan.moe_sizes)
    timed = config["record"]["measured_ms"]["decode_attention.bf16.32"]["tiles_ms"]
    assert set(timed) == {"16w1s1", "32w1s1"} and all(t > 0 for t in timed.values())
    dot = config["record"]["measured_ms"]["gemv.linear.dot"]["tiles_ms"]
    assert set(dot) == {"16x16w1s1", "16x32w1s1", "16x32w1s1/split"}  # split K a candidate too


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="kernels on a CPU need Triton's interpreter"
)
def test_tune_only_some_kernels_keeps_the_others():
    """--only gemv: the gemv section timed (the interpreter's kernels lose to cuBLAS at one row),
    the others as the present choices have them (a CPU's rules), which the record says."""
    from nanovllm_final import tune

    config = tune.tune(torch.device("cpu"), tune.DRY_PLAN, only=["gemv"])
    rules = tuning.rules(tuning.describe(torch.device("cpu")))
    assert config["decode_attention"] == rules["decode_attention"] and config["moe"] == rules["moe"]
    assert set(config["record"]["measured_ms"]) == {
        f"gemv.{kind}.{timed}"
        for kind in tuning.GEMV_KINDS
        for timed in ("loop", "dot", "rows.1")  # cuBLAS wins at one row: no more counts
    }
    for entry in config["gemv"].values():
        assert tuple(entry["dot"].values()) in tune.DRY_PLAN.gemv_dot_tiles
        assert (entry["rows"], entry["dot_rows"]) == (0, 0)
    notes = config["record"]["notes"]
    assert "decode_attention, prefill_attention, moe: not timed" in notes["kept"]
    # the dry plan's rows
    assert notes["gemv"].startswith(
        "per projection kind, over its shapes: the row loop's tiles (loop) summed over 1, 2 rows"
    )
    assert "product's (dot, each tiling also with K split" in notes["gemv"]
    assert "/split) over 3 rows" in notes["gemv"]


@pytest.mark.parametrize(
    "winners, rows, dot_rows",
    [
        ("LLDDC", 2, 4),  # the row loop, then the product, then cuBLAS
        ("LLLLL", 5, 0),
        ("DDLCC", 0, 3),  # the product from one row; the row loop winning later takes nothing
        ("CDDDD", 0, 0),  # cuBLAS at one row: neither kernel
    ],
)
def test_gemv_rows_pick_the_row_loop_then_the_product_then_cublas(winners, rows, dot_rows):
    """Per projection kind, counting rows up, its rows hold while the row loop is the fastest of
    the three at every count, its dot_rows from there while the tensor-core product beats cuBLAS;
    the first count that cuBLAS wins past them ends both."""
    from nanovllm_final import tune

    class Scripted(tune.Timer):
        def fastest(self, choices):
            if set(choices) != {"loop", "dot", "cublas"}:  # a kind's tile list: the first
                self.count = 0  # its rows are counted next
                return next(iter(choices)), dict.fromkeys(choices, 1.0)
            winner = {"L": "loop", "D": "dot", "C": "cublas"}[winners[self.count]]
            self.count += 1
            return winner, {name: 1.0 if name == winner else 2.0 for name in choices}

    timer = Scripted(torch.device("cpu"), 1, None)
    plan = dataclasses.replace(tune.DRY_PLAN, gemv_rows=tuple(range(1, len(winners) + 1)))
    config = tune.tune_gemv(timer, plan, {})
    assert {kind: (e["rows"], e["dot_rows"]) for kind, e in config.items()} == dict.fromkeys(
        tuning.GEMV_KINDS, (rows, dot_rows)
    )


def test_stages_are_cut_to_the_shared_memory():
    """A file's stages were timed in bfloat16; float32 operands double a stage's bytes, and a
    pipeline that no longer fits the device's shared memory runs with fewer stages."""
    cpu = torch.device("cpu")
    smem = tuning.describe(cpu).shared_memory
    tiles = {"BLOCK_N": 64, "num_stages": 4}
    assert tuning.fit_stages(tiles, smem // 3, cpu) == tiles  # 3 stages in flight fit
    assert tuning.fit_stages(tiles, smem // 2, cpu) == {"BLOCK_N": 64, "num_stages": 3}
    assert tuning.fit_stages(tiles, 2 * smem, cpu)["num_stages"] == 1


def test_gemv_tiles_are_timed_on_weights_that_stream_from_memory():
    """One weight timed again and again would sit in the L2 cache; the tuner cycles through copies
    whose bytes exceed twice the L2, and Timer reports the time of one product, not of a cycle."""
    from nanovllm_final import tune

    mib = 2**20
    assert tune.streamed_copies(8 * mib, 50 * mib) == 13  # 104 MiB > 2 x 50 MiB
    assert tune.streamed_copies(64 * mib, 50 * mib) == 2
    assert tune.streamed_copies(1024, 0) == 2  # a CPU: no L2 counted, still two copies
    seen = []
    weights = [torch.full((2, 3), float(i)) for i in range(4)]
    call = tune.streamed(lambda x, w: seen.append(int(w[0, 0])), torch.ones(1, 3), weights)
    call()
    assert seen == [0, 1, 2, 3] and call.calls == 4

    class Bar:
        def update(self, n):
            pass

    timer = tune.Timer(torch.device("cpu"), reps=3, bar=Bar())
    one = timer.ms(lambda: time.sleep(0.004))
    four = timer.ms(tune.streamed(lambda x, w: time.sleep(0.004), None, weights))
    assert 0.5 * one < four < 2 * one  # per product: four sleeps a call, divided by four
