"""The incremental detokenizer (nanovllm_final/engine/detokenizer.py) with the tiny model's
byte-level BPE: characters split over tokens (emoji, CJK) come out whole, stop strings that
span tokens cut the text and are never streamed, and each token costs a bounded window."""

import pytest
from transformers import AutoTokenizer

from nanovllm_final.engine.detokenizer import IncrementalDetokenizer, decoder

TEXT = "naïve café 日本語のテキスト 😀👍🏽 — “quoted” 42 the end"


class CountingTokenizer:
    """The tokenizer, recording how many ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.window_sizes = tokenizer, []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def encode(self, text, **kwargs):
        return self.tokenizer.encode(text, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(str(model_dir("qwen3")))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, verbose=False)


def stream(
    tokenizer, ids: list[int], stop=(), min_tokens: int = 0
) -> tuple[list[str], IncrementalDetokenizer, int | None]:
    """Feed ids one per step as the engine does; the deltas, the detokenizer, the step a stop string ended it."""
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say:"), list(stop), min_tokens)
    deltas = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        stopped = detok.add(t, final=last)
        deltas.append(detok.delta(finished=last or stopped))
        if stopped:
            return deltas, detok, i
    return deltas, detok, None


def test_multibyte_characters_split_over_tokens_come_out_whole(tokenizer):
    ids = encode(tokenizer, TEXT)
    assert (
        tokenizer.decode(ids[:1]) != TEXT[:1] or len(ids) > len(TEXT.split()) * 2
    )  # characters take several tokens
    deltas, detok, _ = stream(tokenizer, ids)
    assert "".join(deltas) == TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(not d for d in deltas) > 0  # some steps wait for the rest of a character


@pytest.mark.parametrize("stop", ["日本語", "😀👍", "“quoted", "the end"])
def test_a_stop_string_spanning_tokens_cuts_the_text_and_is_never_streamed(tokenizer, stop):
    ids = encode(tokenizer, TEXT)
    deltas, detok, at = stream(tokenizer, ids, stop=[stop, "never there"])
    want = TEXT[: TEXT.index(stop)]
    assert at is not None and detok.stopped and detok.text == want
    assert "".join(deltas) == want
    assert (
        tokenizer.decode(ids[: at + 1]).find(stop) != -1
        and tokenizer.decode(ids[:at]).find(stop) == -1
    )  # ends where it completes
    seen = ""
    for (
        d
    ) in deltas:  # no prefix of the stop string reached the client before the text moved past it
        seen += d
        assert stop not in seen


def test_a_held_back_prefix_is_released_when_the_stop_string_does_not_follow(tokenizer):
    text = "one abc two abd three ab"
    deltas, detok, at = stream(tokenizer, encode(tokenizer, text), stop=["abx"])
    assert at is None and "".join(deltas) == text == detok.text
    held = [
        i
        for i, d in enumerate(deltas)
        if "".join(deltas[: i + 1]) != text[: len("".join(deltas[: i + 1]))]
    ]
    assert not held  # every delta is a prefix extension of the text
    partial = "".join(deltas[:-1])
    assert not partial.endswith("ab") and text.startswith(
        partial
    )  # the final "ab" waited for the end


def test_stop_strings_count_only_from_min_tokens(tokenizer):
    ids = encode(tokenizer, "stop here, then stop again and end")
    early = stream(tokenizer, ids, stop=["stop"])[1].text
    late_deltas, late, _ = stream(
        tokenizer, ids, stop=["stop"], min_tokens=len(encode(tokenizer, "stop here,")) + 1
    )
    assert early == ""
    assert late.text == "stop here, then " and "".join(late_deltas) == late.text


def test_each_token_costs_a_bounded_window(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = encode(tokenizer, TEXT * 60)  # thousands of tokens
    assert len(ids) > 1000
    deltas, detok, _ = stream(counting, ids, stop=["never there", "nor this"])
    assert "".join(deltas) == TEXT * 60
    assert max(counting.window_sizes) <= 12  # a few tokens, however long the text
    assert len(counting.window_sizes) <= 2 * len(ids)
    assert len(detok.ids) <= 4096 + 20  # old tokens are forgotten


def test_bytes_that_never_complete_a_character_do_not_stall_it(tokenizer):
    """A token that is the first byte of a 4-byte character, over and over: the window stays
    bounded and the text moves on (with replacement characters)."""
    first_byte = encode(tokenizer, "😀")[0]
    assert "\ufffd" in tokenizer.decode([first_byte])
    counting = CountingTokenizer(tokenizer)
    deltas, detok, _ = stream(counting, [first_byte] * 200 + encode(tokenizer, " done"))
    assert max(counting.window_sizes) <= 12  # a few tokens, however long the text
    assert "".join(deltas).endswith(" done") and "\ufffd" in detok.text


def test_the_fast_decoder_says_what_the_tokenizer_says(tokenizer):
    """Where the tokenizer cleans up no spaces, its Rust decoder is called directly (a fraction
    of the wrapper's cost); the text is the same. Where it does clean up, the wrapper is used."""
    ids = encode(tokenizer, TEXT + " , . ! isn't")
    fast = decoder(tokenizer)
    assert not tokenizer.clean_up_tokenization_spaces
    for i in range(len(ids)):
        window = ids[max(0, i - 4) : i + 1]
        assert fast(window) == tokenizer.decode(window, skip_special_tokens=True)
    counting = CountingTokenizer(tokenizer)
    counting.clean_up_tokenization_spaces, counting._tokenizer = True, tokenizer._tokenizer
    decoder(counting)(ids)
    assert counting.window_sizes == [len(ids)]  # went through decode()


def test_the_held_back_tail_is_the_longest_one_that_could_start_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], ["abcab", "bx", "zz"])
    for unsent, held in [
        ("xxabca", 4),
        ("xxabcab", 2),
        ("xxb", 1),
        ("xxa", 1),
        ("xxq", 0),
        ("z", 1),
        ("", 0),
    ]:
        assert detok._stop_prefix_len(unsent) == held, unsent
