"""Each stage refuses an option that asks for a mechanism it does not have yet, naming the stage
where it arrives, and accepts the rest; its command line has a flag for every option of its API;
it warns only when there is something to act on."""

import importlib
import logging
import os
import subprocess
import sys
from dataclasses import MISSING, fields

import pytest

import stages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = stages.names()

# option values that ask for a mechanism -> the stage where it arrives
MECHANISMS = [
    (dict(attention_backend="triton"), "03_paged"),
    (dict(attention_backend="flash_attn"), "03_paged"),
    (dict(tensor_parallel_size=2), "07_tensor_parallel"),
]


def level(name: str) -> int:
    return int(name[:2])


def cli(name: str):
    return importlib.import_module(f"stages.{name}.__main__").main


@pytest.mark.parametrize("name", STAGES)
@pytest.mark.parametrize(("options", "arrives"), MECHANISMS)
def test_refused_before_its_stage_accepted_from_it(name, options, arrives, model_dir):
    st = stages.load(name)
    if level(name) < level(arrives):
        with pytest.raises(ValueError, match=f"arrives in stage {arrives}; stages.{name} "):
            st.LLM(model_dir("qwen3"), device="cpu", **options)
    else:  # the option's own checks may still apply (devices, packages), but not "arrives in"
        config = importlib.import_module(f"stages.{name}.config")
        if options.get("tensor_parallel_size", 1) > (os.cpu_count() or 1):
            pytest.skip("needs as many CPU cores as ranks")
        config.EngineConfig.from_options(model_dir("qwen3"), device="cpu", **options)


@pytest.mark.parametrize("name", STAGES)
def test_options_that_tune_or_ask_for_what_it_does_are_accepted(name, model_dir):
    st = stages.load(name)
    options = dict(
        device="cpu",
        max_model_len=64,
        enforce_eager=True,
        kvcache_block_size=4,
        num_kvcache_blocks=64,
        max_num_batched_tokens=64,
        tensor_parallel_size=1,
        attention_backend="torch",
        gpu_memory_utilization=0.5,
        cpu_kvcache_bytes=1 << 20,
        max_num_seqs=4,
        seed=1,
    )
    with st.LLM(model_dir("qwen3"), **options) as llm:
        out = llm.generate(
            ["hello"], st.SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
        )
    assert len(out[0]["token_ids"]) == 3


@pytest.mark.parametrize("name", STAGES)
def test_cli_has_a_flag_for_every_option_and_sampling_field(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(name)(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    config = importlib.import_module(f"stages.{name}.config")
    names = [
        f.name
        for cls in (config.EngineConfig, stages.load(name).SamplingParams)
        for f in fields(cls)
        if f.default is not MISSING
    ]
    assert "tensor_parallel_size" in names and "max_tokens" in names
    for field in names:
        assert f"--{field.replace('_', '-')} " in out or f"--{field.replace('_', '-')}," in out, (
            field
        )


@pytest.mark.parametrize("name", STAGES)
def test_cli_passes_options_and_refuses_missing_mechanisms(name, model_dir, capsys):
    main, path = cli(name), str(model_dir("qwen3"))
    capsys.readouterr()  # whatever building the model printed
    main(
        [
            "--model",
            path,
            "--prompt",
            "hello",
            "--device",
            "cpu",
            "--tensor-parallel-size",
            "1",
            "--max-tokens",
            "3",
            "--ignore-eos",
            "--kvcache-block-size",
            "4",
            "--enforce-eager",
        ]
    )
    assert capsys.readouterr().out.startswith("### hello\n")
    with pytest.raises(
        SystemExit
    ) as exit_info:  # the flag reaches the engine: its own limit is reported
        main(
            ["--model", path, "--prompt", "hello " * 20, "--device", "cpu", "--max-model-len", "8"]
        )
    assert exit_info.value.code == 2 and "max_model_len is 8" in capsys.readouterr().err
    if level(name) < 7:
        with pytest.raises(SystemExit) as exit_info:
            main(
                [
                    "--model",
                    path,
                    "--prompt",
                    "hello",
                    "--device",
                    "cpu",
                    "--tensor-parallel-size",
                    "2",
                ]
            )
        err = capsys.readouterr().err
        assert exit_info.value.code == 2
        assert err.startswith("error: tensor_parallel_size=2") and "07_tensor_parallel" in err


def test_cli_refusal_is_one_line_without_traceback(model_dir):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "stages.02_kvcache",
            "--model",
            str(model_dir("qwen3")),
            "--prompt",
            "hi",
            "--device",
            "cpu",
            "--tensor-parallel-size",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: tensor_parallel_size=2 asks for tensor parallelism: it arrives in stage 07_tensor_parallel; "
        "stages.02_kvcache runs on one device"
    ]


@pytest.mark.parametrize("name", STAGES)
def test_too_long_prompt_is_our_error_alone(name, model_dir, transformers_log):
    st = stages.load(name)
    with st.LLM(model_dir("qwen3"), device="cpu", enforce_eager=True) as llm:
        too_long = "the old lighthouse " * (
            llm.tokenizer.model_max_length // 2
        )  # beyond the tokenizer's limit too
        assert (
            len(llm.tokenizer.encode(too_long, add_special_tokens=False, verbose=False))
            > llm.tokenizer.model_max_length
        )
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([too_long], use_tqdm=False)
    assert not [r for r in transformers_log if "sequence length" in r.getMessage()]


@pytest.mark.parametrize("name", [n for n in STAGES if level(n) >= 6])
def test_cpu_eager_is_info_not_warning(name, model_dir, caplog):
    st = stages.load(name)
    caplog.set_level(logging.INFO, logger=st.__name__)
    for _ in range(2):
        with st.LLM(model_dir("qwen3"), device="cpu", max_model_len=32):
            pass
    mine = [r for r in caplog.records if r.name.startswith(st.__name__)]
    assert [r.levelname for r in mine if "CUDA graphs need a CUDA device" in r.getMessage()] == [
        "INFO",
        "INFO",
    ]
    assert not [r for r in mine if r.levelno >= logging.WARNING]
    caplog.clear()
    with st.LLM(
        model_dir("qwen3"), device="cpu", max_model_len=32, enforce_eager=True
    ):  # eager on purpose: silent
        pass
    assert not [r for r in caplog.records if r.name.startswith(st.__name__)]


@pytest.mark.parametrize("name", [n for n in STAGES if level(n) >= 6])
def test_warnings_once_per_process(name, caplog):
    runner = importlib.import_module(f"stages.{name}.engine.model_runner")
    message = f"test warning for {name}"
    for _ in range(3):
        runner.log_once(logging.WARNING, message)
    assert [r.getMessage() for r in caplog.records if r.name == runner.__name__] == [message]
