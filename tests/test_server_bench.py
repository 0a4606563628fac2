"""benchmarks/serve_bench.py on the tiny model on CPU: Poisson arrivals, goodput, and the
offline engine on the same requests in the same call (no timing is asserted)."""

import json

import pytest

from benchmarks import serve_bench

pytestmark = pytest.mark.xdist_group("processes")


def test_request_rate_goodput_and_offline_ratio(model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = serve_bench.main(["--model", str(model_dir("qwen3")), "--device", "cpu", "--workload", "tiny-cpu", "--num-seqs", "6",
                             "--max-output-len", "6", "--request-rate", "50", "--goodput", "ttft:100000", "e2e:100000",
                             "--engine-option", "max_model_len=512", "--engine-option", "num_kvcache_blocks=256", "--offline",
                             "--out", str(out)])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["request_rate"] == 50 and record["completed"] == record["num_requests"] == 6 and record["failed"] == 0
    assert record["engine_options"] == {"max_model_len": "512", "num_kvcache_blocks": "256"}
    good = record["goodput"]
    assert good["objectives_s"] == {"ttft_s": 100.0, "e2e_s": 100.0}
    assert good["good_requests"] == 6 and good["output_tokens_per_s"] == pytest.approx(record["output_tokens_per_s"])
    offline = record["offline"]
    assert offline["output_tokens"] == record["output_tokens"]  # the same requests, ignore_eos: the same token count
    assert offline["served_over_offline"] == pytest.approx(record["output_tokens_per_s"] / offline["output_tokens_per_s"])
    assert "served / offline = " in capsys.readouterr().err
    with pytest.raises(SystemExit, match="the metric must be ttft, tpot or e2e"):
        serve_bench.main(["--url", "http://127.0.0.1:1", "--vocab-size", "10", "--goodput", "latency:5"])


def test_goodput_counts_the_requests_that_meet_every_objective():
    done = [{"ttft_s": 0.05, "tpot_s": 0.01, "e2e_s": 1.0, "output_tokens": 10},
            {"ttft_s": 0.50, "tpot_s": 0.01, "e2e_s": 1.0, "output_tokens": 20},  # TTFT too slow
            {"ttft_s": 0.05, "tpot_s": 0.09, "e2e_s": 1.0, "output_tokens": 40},  # TPOT too slow
            {"ttft_s": 0.05, "tpot_s": None, "e2e_s": 0.1, "output_tokens": 1}]  # one token: no TPOT to miss
    got = serve_bench.goodput(done, serve_bench.parse_goodput(["ttft:100", "tpot:50"]), wall=2.0)
    assert got["good_requests"] == 2 and got["requests_per_s"] == 1.0 and got["output_tokens_per_s"] == 5.5
    assert serve_bench.goodput(done, {}, wall=2.0) is None
