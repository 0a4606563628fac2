"""The course model's draft (models/course-llama-draft): the checkpoint its log describes, the
course model's vocabulary and tokenizer, nanovllm_final's greedy tokens equal Hugging Face's,
and it guesses the course model's next token often enough to speculate with."""

import hashlib
import json

import pytest
from common import ROOT, generate_and_compare, load_engine

from benchmarks import draft_agreement

COURSE_MODEL = ROOT / "models" / "course-llama"
DRAFT = ROOT / "models" / "course-llama-draft"
OPENING = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def log() -> dict:
    return json.loads((DRAFT / "training_log.json").read_text())


def test_checkpoint_is_the_recorded_run(log):
    for name, digest in log["sha256"].items():
        assert hashlib.sha256((DRAFT / name).read_bytes()).hexdigest() == digest, name
    assert json.loads((DRAFT / "config.json").read_text()) == log["config"]
    assert 0.7e6 <= log["parameters"] <= 1.5e6
    assert sum(f.stat().st_size for f in DRAFT.iterdir()) <= 5 * 1024**2
    assert log["final_val_loss"] < 0.8


def test_same_vocabulary_and_tokenizer_as_the_course_model():
    """Token ids must mean the same in both models: the tokenizer files are the very bytes."""
    config, course = (json.loads((d / "config.json").read_text()) for d in (DRAFT, COURSE_MODEL))
    assert config["vocab_size"] == course["vocab_size"]
    for key in ("bos_token_id", "eos_token_id"):
        assert config[key] == course[key]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (DRAFT / name).read_bytes() == (COURSE_MODEL / name).read_bytes(), name


def test_greedy_matches_hf(hf_greedy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DRAFT)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a kind cat."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in (OPENING, chat)]
    st = load_engine("final")
    with st.LLM(
        DRAFT, device="cpu", max_model_len=128, kvcache_block_size=4, max_num_seqs=2
    ) as llm:
        generate_and_compare(st, llm, DRAFT, prompts, hf_greedy, max_tokens=16)


def test_draft_guesses_the_course_models_tokens():
    """Teacher-forced on the course model's greedy text, the draft's argmax is mostly its token
    (a model of the same shape with random weights would agree about 1 time in 2048)."""
    record = draft_agreement.measure(COURSE_MODEL, DRAFT, num_prompts=2, max_tokens=24, max_k=2)
    assert record["positions"] == 48 and record["agreement"] >= 0.5, record


def test_replayed_tokens_per_step():
    """k=2 on [hit, hit, miss, hit]: a step of 3 (two proposals and the target's token), then one
    of 1 at the end; the formula is (1 - a^3) / (1 - a)."""
    assert draft_agreement.replayed_tokens_per_step([[True, True, False, True]], k=2) == 2.0
    assert draft_agreement.replayed_tokens_per_step([[False] * 5], k=4) == 1.0
    assert draft_agreement.expected_tokens_per_step(0.5, 2) == 1.75
    assert draft_agreement.expected_tokens_per_step(1.0, 3) == 4.0
