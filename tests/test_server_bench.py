"""benchmarks/serve_bench.py on the tiny model on CPU: Poisson arrivals, goodput, and the
offline engine on the same requests in the same call (no timing is asserted); the offline
decode step at the server's batch from benchmarks.run's per-step stats; the served table
(benchmarks/tables.py) on records with and without the newer fields."""

import json

import pytest

from benchmarks import run, serve_bench, tables

pytestmark = pytest.mark.xdist_group("processes")


def test_request_rate_goodput_and_offline_ratio(model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = serve_bench.main(
        [
            "--model",
            str(model_dir("qwen3")),
            "--device",
            "cpu",
            "--workload",
            "tiny-cpu",
            "--num-seqs",
            "6",
            "--max-output-len",
            "6",
            "--request-rate",
            "50",
            "--goodput",
            "ttft:100000",
            "e2e:100000",
            "--engine-option",
            "max_model_len=512",
            "--engine-option",
            "num_kvcache_blocks=256",
            "--offline",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())
    assert (
        record["request_rate"] == 50
        and record["completed"] == record["num_requests"] == 6
        and record["failed"] == 0
    )
    assert record["engine_options"] == {"max_model_len": "512", "num_kvcache_blocks": "256"}
    good = record["goodput"]
    assert good["objectives_s"] == {"ttft_s": 100.0, "e2e_s": 100.0}
    assert good["good_requests"] == 6 and good["output_tokens_per_s"] == pytest.approx(
        record["output_tokens_per_s"]
    )
    offline = record["offline"]
    assert (
        offline["output_tokens"] == record["output_tokens"]
    )  # the same requests, ignore_eos: the same token count
    assert offline["served_over_offline"] == pytest.approx(
        record["output_tokens_per_s"] / offline["output_tokens_per_s"]
    )
    by_batch = offline["stats"][
        "decode_steps_by_num_seqs"
    ]  # benchmarks.run's decode steps, by batch size
    assert by_batch and all(int(n) >= 1 and row["steps"] >= 1 for n, row in by_batch.items())
    assert (
        offline["decode_step_at_batch"] is None and offline["tpot_p50_over_decode_step"] is None
    )  # Poisson: no one batch
    err = capsys.readouterr().err
    assert (
        "served / offline = " in err
        and "(target >= 90%: " in err
        and "mean of all its decode steps" in err
        and "not computed" in err
    )
    with pytest.raises(SystemExit, match="the metric must be ttft, tpot or e2e"):
        serve_bench.main(
            ["--url", "http://127.0.0.1:1", "--vocab-size", "10", "--goodput", "latency:5"]
        )


def test_goodput_counts_the_requests_that_meet_every_objective():
    done = [
        {"ttft_s": 0.05, "tpot_s": 0.01, "e2e_s": 1.0, "output_tokens": 10},
        {"ttft_s": 0.50, "tpot_s": 0.01, "e2e_s": 1.0, "output_tokens": 20},  # TTFT too slow
        {"ttft_s": 0.05, "tpot_s": 0.09, "e2e_s": 1.0, "output_tokens": 40},  # TPOT too slow
        {"ttft_s": 0.05, "tpot_s": None, "e2e_s": 0.1, "output_tokens": 1},
    ]  # one token: no TPOT to miss
    got = serve_bench.goodput(done, serve_bench.parse_goodput(["ttft:100", "tpot:50"]), wall=2.0)
    assert (
        got["good_requests"] == 2
        and got["requests_per_s"] == 1.0
        and got["output_tokens_per_s"] == 5.5
    )
    assert serve_bench.goodput(done, {}, wall=2.0) is None


def steps_of(batches: list[tuple[int, int, float, bool]]) -> list[dict]:
    """Engine per-step records: (count, num_seqs, seconds, is_prefill) runs of steps."""
    return [
        {"num_seqs": n, "num_tokens": n, "seconds": sec, "is_prefill": pre}
        for count, n, sec, pre in batches
        for _ in range(count)
    ]


def test_decode_step_at_the_servers_batch_from_per_step_stats():
    steps = steps_of(
        [
            (4, 64, 0.050, True),  # prefill steps of 64 sequences: not decode steps
            (30, 64, 0.004, False),
            (5, 63, 0.002, False),
            (10, 10, 0.001, False),
        ]
    )
    stats = run.summarize_stats(steps)
    assert stats["decode_steps_by_num_seqs"] == {
        "10": {"steps": 10, "ms_mean": pytest.approx(1.0)},
        "63": {"steps": 5, "ms_mean": pytest.approx(2.0)},
        "64": {"steps": 30, "ms_mean": pytest.approx(4.0)},
    }
    assert stats["decode_step_ms_mean"] == pytest.approx(
        (30 * 4 + 5 * 2 + 10 * 1) / 45
    )  # every decode step, unchanged
    exact = serve_bench.decode_step_at_batch(stats, 64)
    assert exact == {
        "batch": 64,
        "num_seqs_min": 64,
        "num_seqs_max": 64,
        "steps": 30,
        "ms_mean": pytest.approx(4.0),
    }
    wider = serve_bench.decode_step_at_batch(
        stats, 64, min_steps=31
    )  # too few at 64: the narrowest window that has enough
    assert (wider["num_seqs_min"], wider["num_seqs_max"], wider["steps"]) == (63, 64, 35)
    assert wider["ms_mean"] == pytest.approx((30 * 4 + 5 * 2) / 35)  # weighted by steps
    far = serve_bench.decode_step_at_batch(
        stats, 16
    )  # none at 16: steps of 10 (6 away) hold only 10, so on to 63-64
    assert (far["num_seqs_min"], far["num_seqs_max"], far["steps"]) == (10, 64, 45)
    assert (
        serve_bench.decode_step_at_batch(stats, 64, min_steps=1000)["steps"] == 45
    )  # never enough: all of them
    assert (
        serve_bench.decode_step_at_batch({"decode_step_ms_mean": 4.0}, 64) is None
    )  # an older record's stats
    assert serve_bench.decode_step_at_batch(None, 64) is None


def test_the_servers_batch_and_the_targets():
    def batch(*argv):
        return serve_bench.server_batch(serve_bench.parse_args(["--url", "http://x", *argv]))

    assert batch("--concurrency", "256", "--engine-option", "max_num_seqs=64") == 64
    assert batch("--concurrency", "16", "--engine-option", "max_num_seqs=64") == 16
    assert batch("--engine-option", "max_num_seqs=256") == 64  # the default 64 clients
    assert batch("--concurrency", "16") is None  # the server's own default is not known here
    assert (
        batch("--concurrency", "16", "--engine-option", "max_num_seqs=64", "--request-rate", "5")
        is None
    )
    assert serve_bench.target_met("served_over_offline", 0.95) and not serve_bench.target_met(
        "served_over_offline", 0.85
    )
    assert serve_bench.target_met("tpot_p50_over_decode_step", 1.2) and not serve_bench.target_met(
        "tpot_p50_over_decode_step", 1.3
    )
    assert serve_bench.target_met("tpot_p50_over_decode_step", None) is None
    assert (
        serve_bench.verdict("served_over_offline", {"served_over_offline": 0.94})
        == "target >= 90%: met"
    )
    assert (
        serve_bench.verdict("tpot_p50_over_decode_step", {"tpot_p50_over_decode_step": 1.3})
        == "target <= 1.25: MISSED"
    )


def serve_record(concurrency: int, *, at_batch: bool, offline: bool = True) -> dict:
    record = {
        "benchmark": "serve",
        "command": f"python -m benchmarks.serve_bench --concurrency {concurrency}",
        "concurrency": concurrency,
        "request_rate": None,
        "num_requests": 2 * concurrency,
        "output_tokens_per_s": 1000.0 * concurrency,
        "engine_options": {"max_num_seqs": str(concurrency)},
        "ttft_s": {"p50": 0.050, "p90": 0.120},
        "tpot_s": {"p50": 0.006, "p90": 0.0075},
        "offline": None,
    }
    if offline:
        record["offline"] = {
            "output_tokens_per_s": 1250.0 * concurrency,
            "served_over_offline": 0.8,
            "stats": {"decode_step_ms_mean": 4.5},
        }
        if at_batch:
            record["offline"] |= {
                "decode_step_at_batch": {
                    "batch": concurrency,
                    "num_seqs_min": concurrency - 2,
                    "num_seqs_max": concurrency,
                    "steps": 40,
                    "ms_mean": 5.0,
                },
                "tpot_p50_over_decode_step": 1.2,
            }
    return record


def test_serve_table_shows_a_dash_for_a_field_a_record_lacks(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    for c, kwargs in (
        (64, {"at_batch": False}),
        (16, {"at_batch": True}),
        (4, {"at_batch": False, "offline": False}),
    ):
        (tmp_path / f"serve_x_c{c}_h200.json").write_text(json.dumps(serve_record(c, **kwargs)))
    rows = [line.split(" | ") for line in tables.serve_table("").splitlines()[2:]]
    assert [row[0] for row in rows] == ["| 4", "| 16", "| 64"]  # by clients, not by file name
    no_offline, new, old = rows
    assert new[3:] == [
        "16,000",
        "20,000",
        "80%",
        "50 / 120",
        "6.00 / 7.50",
        "4.50",
        "16",
        "5.00 (steps of 14–16 sequences)",
        "1.20",
        "[`serve_x_c16_h200.json`](benchmarks/results/serve_x_c16_h200.json) |",
    ]
    assert old[3:6] == ["64,000", "80,000", "80%"] and old[8:12] == [
        "4.50",
        "64",
        "—",
        "—",
    ]  # no step at the batch
    assert (
        no_offline[4:6] == ["—", "—"] and no_offline[8] == "—" and no_offline[10:12] == ["—", "—"]
    )
    points = [p for _, p in tables.serve_points(directory=tmp_path)]
    assert [p["tpot_p50_over_decode_step"] for p in points] == [None, 1.2, None]


def test_serve_stop_strings_measures_both_runs_on_the_same_tokens(model_dir, tmp_path, capsys):
    """benchmarks/serve_stop_strings.py on the tiny model: the workload without and with stop
    strings that never occur generates the same tokens (no timing is asserted)."""
    from benchmarks import serve_stop_strings

    out = tmp_path / "stop.json"
    code = serve_stop_strings.main(
        [
            "--model",
            str(model_dir("qwen3")),
            "--device",
            "cpu",
            "--workload",
            "tiny-cpu",
            "--num-seqs",
            "4",
            "--concurrency",
            "2",
            "--max-output-len",
            "6",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["this"] and list(runs["this"]) == ["no stop strings", "stop strings"]
    plain, stopped = runs["this"].values()
    assert plain["completed"] == stopped["completed"] == 4
    assert plain["output_tokens"] == stopped["output_tokens"] > 4
    assert stopped["stopped"] == 0 and stopped["tpot_s"]["p50"] > 0
    assert "TPOT p50 ms" in capsys.readouterr().out
