"""The `nanovllm` command line (python -m nanovllm_final): generate, chat, bench, and the
same sampling defaults as the Python API."""

import io
import json
import os
import subprocess
import sys

import pytest
from common import ROOT

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.__main__ import build_parser, main
from nanovllm_final.config import EngineConfig
from nanovllm_final.validate import options
from nanovllm_final.workloads import make_workload


def nanovllm(*args: str) -> subprocess.CompletedProcess:
    """`python -m nanovllm_final ARGS` (what the `nanovllm` console script runs) in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", "nanovllm_final", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_help_teaches(capsys):
    out = nanovllm("--help")
    assert out.returncode == 0
    for command in ("generate", "chat", "bench", "serve"):
        assert f"\n    {command} " in out.stdout, out.stdout  # listed with its one-line help
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    for option in (
        "--top-p",
        "--top-k",
        "--min-p",
        "--seed",
        "--stop",
        "--logprobs",
        "--n",
        "--tensor-parallel-size",
        "--engine-seed",
    ):
        assert option in text
    assert (
        '\n[project.scripts]\nnanovllm = "nanovllm_final.__main__:main"\n'
        in (ROOT / "pyproject.toml").read_text()
    )


def test_serve_is_a_command(tmp_path):
    """`nanovllm serve MODEL ...` is the server's command line (nanovllm_final/server/cli.py), with
    the same engine flags as the other commands; it reaches the server's start-up."""
    out = nanovllm("serve", "--help")
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.startswith("usage: nanovllm serve ")
        and "[model]" in out.stdout
        and "--model MODEL" in out.stdout
    )
    for option in (
        "--port",
        "--served-model-name",
        "--max-pending-requests",
        "--max-num-seqs",
        "--tensor-parallel-size",
        "--engine-seed",
    ):
        assert option in out.stdout
    missing = tmp_path / "no-such-model"
    for model in (
        [str(missing)],
        ["--model", str(missing)],
    ):  # the model as its first argument, or as generate takes it
        out = nanovllm("serve", *model, "--device", "cpu", "--max-num-seqs", "4")
        assert (
            out.returncode == 2 and out.stderr.startswith("error: ") and str(missing) in out.stderr
        ), out.stderr
    out = nanovllm("serve", "--device", "cpu")
    assert out.returncode == 2 and "give the model once" in out.stderr, out.stderr


def test_generate_json_equals_the_api(model_dir, capsys):
    path = model_dir("qwen3")
    capsys.readouterr()  # the factory's messages, if it built the model just now
    args = [
        "--model",
        str(path),
        "--device",
        "cpu",
        "--max-model-len",
        "64",
        "--prompt",
        "hello",
        "--prompt",
        "the cat",
    ]
    main(["generate", *args, "--max-tokens", "6", "--temperature", "0", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with LLM(path, device="cpu", max_model_len=64) as llm:
        expected = llm.generate(
            ["hello", "the cat"], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False
        )
    assert [line["prompt"] for line in lines] == ["hello", "the cat"]
    assert [line["token_ids"] for line in lines] == [e["token_ids"] for e in expected]
    main(
        [*args, "--max-tokens", "3", "--n", "2", "--seed", "1", "--chat"]
    )  # the stages' form, without "generate"
    out = capsys.readouterr().out
    assert out.startswith("### hello\n") and out.count("--- length") == 4


def test_chat_streams_replies(model_dir, capsys, monkeypatch):
    model_dir("qwen3")
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n\n/reset\nand again\n/exit\n"))
    main(
        [
            "chat",
            "--model",
            str(model_dir("qwen3")),
            "--device",
            "cpu",
            "--max-model-len",
            "128",
            "--max-tokens",
            "4",
            "--system",
            "Be brief.",
            "--temperature",
            "0",
        ]
    )
    assert capsys.readouterr().out.count("assistant> ") == 2


def test_bench_writes_json(model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(
        [
            "bench",
            "--model",
            str(model_dir("qwen3")),
            "--device",
            "cpu",
            "--max-model-len",
            "64",
            "--num-seqs",
            "3",
            "--min-input-len",
            "4",
            "--max-input-len",
            "12",
            "--min-output-len",
            "2",
            "--max-output-len",
            "5",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    _, params = make_workload(
        "nanovllm",
        512,
        num_seqs=3,
        min_input_len=4,
        max_input_len=12,
        min_output_len=2,
        max_output_len=5,
    )
    assert (
        result["output_tokens"] == sum(p["max_tokens"] for p in params)
        and result["metrics"]["requests"] == 3
    )  # the workload's
    assert result["workload"] == "nanovllm" and "tokens/s" in capsys.readouterr().out


def test_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "/no/such/dir", "--prompt", "hi"])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "/no/such/dir", "--prompt", "hi", "--top-p", "0"])
    assert exit_info.value.code == 2 and "top_p" in capsys.readouterr().err


def test_boolean_engine_flags():
    """An option off by default is turned on by --x; one on by default (overlap scheduling) gets --no-x."""
    import argparse

    from nanovllm_final.engine_flags import add_engine_options, engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_options(parser.parse_args([])) == {}
    assert engine_options(parser.parse_args(["--enforce-eager", "--no-overlap-scheduling"])) == {
        "enforce_eager": True,
        "overlap_scheduling": False,
    }
    assert engine_options(parser.parse_args(["--overlap-scheduling"])) == {
        "overlap_scheduling": True
    }


def test_flags_are_generated_from_the_option_fields():
    """Every SamplingParams and EngineConfig field is a flag of generate, chat and bench, with
    the help written in its field; a value the field refuses is refused on the command line too."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("generate", "chat", "bench"):
        helps = {a.dest: a.help for a in commands[name]._actions}
        for o in options(SamplingParams):
            assert helps[o.name].startswith(o.help), (name, o.name)
        for o in options(EngineConfig):
            assert helps[f"engine_{o.name}"].startswith(o.help), (name, o.name)
    args = parser.parse_args(
        [
            "generate",
            "--model",
            "m",
            "--stop",
            "a",
            "--stop",
            "b",
            "--stop-token-ids",
            "3",
            "--ignore-eos",
            "--top-k",
            "5",
        ]
    )
    from nanovllm_final.engine_flags import sampling_params

    p = sampling_params(args)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.top_k, p.temperature) == (
        ["a", "b"],
        [3],
        True,
        5,
        None,
    )
    with pytest.raises(ValueError, match="temperature"):
        sampling_params(parser.parse_args(["generate", "--model", "m", "--temperature", "nan"]))
