"""What the final engine logs: a warning only when there is something to act on, and each
note once per process; no transformers warning about the tokenizer's own length limit."""

import logging
import types

import pytest
import torch

from nanovllm_final import LLM
from nanovllm_final.engine import model_runner

EAGER_NOTE = "CUDA graphs need a CUDA device"


@pytest.fixture
def fresh_process_notes():
    """As if no engine had been built in this process yet (log_once remembers what it said)."""
    model_runner.log_once.cache_clear()
    yield
    model_runner.log_once.cache_clear()


def test_cpu_eager_is_info_once_per_process(model_dir, caplog, fresh_process_notes):
    caplog.set_level(logging.INFO, logger="nanovllm_final")
    for _ in range(2):
        with LLM(model_dir("qwen3"), device="cpu", max_model_len=32):
            pass
    mine = [r for r in caplog.records if r.name.startswith("nanovllm_final")]
    assert [r.levelname for r in mine if EAGER_NOTE in r.getMessage()] == ["INFO"]
    assert not [r for r in mine if r.levelno >= logging.WARNING]
    caplog.clear()
    model_runner.log_once.cache_clear()
    with LLM(
        model_dir("qwen3"), device="cpu", max_model_len=32, enforce_eager=True
    ):  # eager on purpose: silent
        pass
    assert not [r for r in caplog.records if r.name.startswith("nanovllm_final")]


def test_uncapturable_backend_on_cuda_warns_once_with_the_remedy(caplog, fresh_process_notes):
    """The decision alone (no GPU here): a CUDA runner whose backend cannot be captured runs
    eagerly and says, once per process, which backend would capture graphs."""
    runner = types.SimpleNamespace(
        config=types.SimpleNamespace(enforce_eager=False),
        device=torch.device("cuda", 0),
        attention_backend=types.SimpleNamespace(name="torch", capturable=False),
    )
    with caplog.at_level(logging.INFO, logger="nanovllm_final"):
        assert [model_runner.ModelRunner.use_cudagraphs(runner) for _ in range(3)] == [False] * 3
    (record,) = [r for r in caplog.records if r.name == model_runner.__name__]
    assert record.levelname == "WARNING"
    assert (
        "torch attention backend" in record.getMessage()
        and "attention_backend='triton'" in record.getMessage()
    )
    runner.attention_backend = types.SimpleNamespace(name="triton", capturable=True)
    assert model_runner.ModelRunner.use_cudagraphs(runner)


def test_too_long_prompt_is_our_error_alone(model_dir, transformers_log):
    with LLM(model_dir("qwen3"), device="cpu", enforce_eager=True) as llm:
        too_long = "the old lighthouse " * (
            llm.tokenizer.model_max_length // 2
        )  # beyond the tokenizer's limit too
        assert len(llm.encode(too_long)) > llm.tokenizer.model_max_length
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([too_long], use_tqdm=False)
        with pytest.raises(ValueError, match="max_model_len"):
            llm.chat([{"role": "user", "content": too_long}], use_tqdm=False)
    assert not [r for r in transformers_log if "sequence length" in r.getMessage()]
