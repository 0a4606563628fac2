"""The committed course model (models/course-llama): it loads in every engine, each engine's
greedy tokens equal Hugging Face's, and what it writes is English, not noise."""

import hashlib
import json
import shutil

import pytest
import torch
from common import ENGINES, ROOT, generate_and_compare, level, load_engine
from transformers import AutoModelForCausalLM, AutoTokenizer

from tools.course_model import stories
from tools.tiny_model import make_model

COURSE_MODEL = ROOT / "models" / "course-llama"
OPENING = "Once upon a time, in a small village by the sea,"  # a shared opening of the stories
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(COURSE_MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """A story opening, a chat request, and the opening again with more words (a shared prefix)."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story about a brave fox named Rusty."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    texts = [OPENING, chat, OPENING + " there lived a shy girl named"]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def english_share(text: str) -> float:
    """The share of the text's words that the story grammar can write."""
    words = stories.words(text)
    return sum(w in stories.vocabulary() for w in words) / max(1, len(words))


def hf_greedy_text(path, tokenizer, prompt: str, max_new_tokens: int) -> str:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_checkpoint_is_the_recorded_run():
    """The weights and tokenizer are those training_log.json describes (a retrained or edited
    checkpoint must come with its log), and they fit the repo's size limit."""
    log = json.loads((COURSE_MODEL / "training_log.json").read_text())
    for name, digest in log["sha256"].items():
        assert hashlib.sha256((COURSE_MODEL / name).read_bytes()).hexdigest() == digest, name
    assert json.loads((COURSE_MODEL / "config.json").read_text()) == log["config"]
    assert sum(f.stat().st_size for f in COURSE_MODEL.iterdir()) <= 20 * 1024**2
    assert log["final_val_loss"] < 0.5


@pytest.mark.parametrize("engine", ENGINES)
def test_greedy_matches_hf(engine, prompts, hf_greedy):
    """Block size 4 and two batch slots: the third prompt runs after the first, whose opening it
    shares; from 04 on, it reuses the first prompt's cached blocks."""
    st = load_engine(engine)
    with st.LLM(
        COURSE_MODEL, device="cpu", max_model_len=256, kvcache_block_size=4, max_num_seqs=2
    ) as llm:
        generate_and_compare(st, llm, COURSE_MODEL, prompts, hf_greedy, max_tokens=MAX_TOKENS)
        if level(engine) >= 4:
            assert sum(step.get("prefix_hit_blocks", 0) for step in llm.stats) > 0


def test_greedy_story_is_english(tokenizer):
    text = hf_greedy_text(COURSE_MODEL, tokenizer, OPENING, max_new_tokens=60)
    words = stories.words(text)
    assert len(words) >= 30 and len(set(words)) >= 15, text  # no collapse into one repeated word
    assert english_share(text) >= 0.8, text


def test_english_check_catches_a_broken_checkpoint(tmp_path, tokenizer):
    """The same shape and tokenizer with random weights writes text the check rejects."""
    config = json.loads((COURSE_MODEL / "config.json").read_text())
    shape = {
        k: config[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "max_position_embeddings",
        )
    }
    broken = make_model(
        tmp_path / "broken", arch="llama", tie_word_embeddings=True, init_std=0.2, **shape
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(COURSE_MODEL / name, broken / name)
    text = hf_greedy_text(broken, tokenizer, OPENING, max_new_tokens=60)
    assert english_share(text) < 0.8, text


def test_stories_are_deterministic_and_in_the_vocabulary():
    first = stories.stories(200)
    assert first == stories.stories(200) and len(set(first)) == 200
    assert stories.stories(5, seed=1) != first[:5]
    assert stories.stories(3, start=7) == first[7:10]
    assert {
        w
        for s in first
        for w in stories.words(s.replace("<|im_start|>", " ").replace("<|im_end|>", " "))
    } <= stories.vocabulary()
