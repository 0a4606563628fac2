"""The final engine's API: result dicts, stop strings, streaming, n completions sharing a
prompt's blocks, chat, incremental detokenization, and the engine-level request API
(add_request / step / abort_request) that servers build on."""

import pytest
from common import random_prompts

from nanovllm_final import LLM, RequestOutput, SamplingParams
from nanovllm_final.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(model_dir("qwen3"), device="cpu", max_model_len=64, kvcache_block_size=4) as llm:
        yield llm


def test_result_dict(llm):
    prompt = random_prompts([7], seed=1)[0]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )[0]
    assert (
        out["prompt_token_ids"] == prompt
        and out["finish_reason"] == "length"
        and out["logprobs"] is None
    )
    assert len(out["token_ids"]) == 6 and out["text"] == llm.tokenizer.decode(
        out["token_ids"], skip_special_tokens=True
    )
    assert out["outputs"] == [
        {k: out[k] for k in ("text", "token_ids", "finish_reason", "logprobs")}
    ]
    m = out["metrics"]
    assert (
        m["prompt_tokens"] == 7
        and m["cached_prompt_tokens"] == 0
        and 0 < m["ttft_s"]
        and 0 < m["tpot_s"]
    )
    long = llm.generate(
        [random_prompts([60], seed=2)[0]],
        SamplingParams(max_tokens=None, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(long["token_ids"]) == 4 and long["finish_reason"] == "length"  # max_model_len 64
    with pytest.raises(ValueError, match="prompt 0 has 64 tokens; max_model_len is 64"):
        llm.generate([list(range(3, 67))], use_tqdm=False)


def boundary_stop(llm, token_ids: list[int]) -> tuple[str, str, int] | None:
    """A 2-character stop string spanning two tokens' texts, whose first occurrence is that boundary."""
    text = llm.tokenizer.decode(token_ids, skip_special_tokens=True)
    for i in range(1, len(token_ids)):
        left = llm.tokenizer.decode(token_ids[:i], skip_special_tokens=True)
        right = llm.tokenizer.decode(token_ids[i : i + 1], skip_special_tokens=True)
        if left and right and text.startswith(left) and "\ufffd" not in text[: len(left) + 1]:
            stop = left[-1] + text[len(left)]
            if text.find(stop) == len(left) - 1 and not stop.isspace():
                return text, stop, len(left) - 1
    return None


def test_stop_string_across_tokens(llm):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for seed in range(10):
        prompt = random_prompts([5], seed=20 + seed)[0]
        greedy = llm.generate([prompt], params, use_tqdm=False)[0]
        found = boundary_stop(llm, greedy["token_ids"])
        if found:
            break
    text, stop, at = found
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop, "never-there"]),
        use_tqdm=False,
    )[0]
    assert out["text"] == text[:at] and out["finish_reason"] == "stop"
    assert out["token_ids"] == greedy["token_ids"][: len(out["token_ids"])]
    events = list(
        llm.stream(
            [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=stop)
        )
    )
    assert "".join(e["text"] for e in events) == text[:at]
    assert events[-1]["finished"] and events[-1]["finish_reason"] == "stop"
    assert not any(
        stop[0] == e["text"][-1:] for e in events[:-1] if e["text"]
    )  # a possible start is held back


def test_stream_equals_generate(llm):
    prompts = random_prompts([6, 11], seed=3)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, n=2, max_tokens=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts, ids, ends = {}, {}, {}
    for e in llm.stream(prompts, params):
        key = (e["index"], e["completion"])
        assert key not in ends  # nothing after the end
        texts[key] = texts.get(key, "") + e["text"]
        ids[key] = ids.get(key, []) + e["token_ids"]
        if e["finished"]:
            ends[key] = e["finish_reason"]
    for i, out in enumerate(outs):
        for j, c in enumerate(out["outputs"]):
            assert (texts[i, j], ids[i, j], ends[i, j]) == (
                c["text"],
                c["token_ids"],
                c["finish_reason"],
            )


def test_n_completions_share_the_prompt_blocks(llm):
    prompt = random_prompts([21], seed=4)[0]  # 5 full blocks of 4, then the last token's block
    llm.stats.clear()
    out = llm.generate(
        [prompt],
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [len(c["token_ids"]) for c in out["outputs"]] == [8, 8, 8]
    assert len({tuple(c["token_ids"]) for c in out["outputs"]}) > 1  # different completions
    assert out["outputs"][0]["token_ids"] == out["token_ids"]
    assert (
        sum(s["prefix_hit_tokens"] for s in llm.stats) == 2 * 20
    )  # both siblings found the leader's 5 blocks
    assert out["metrics"]["cached_prompt_tokens"] == 20
    assert (
        sum(s["num_tokens"] for s in llm.stats if s["is_prefill"]) < 3 * 21
    )  # the prompt was not computed 3 times


def test_chat_prompt_is_the_chat_template(llm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is the lighthouse?"},
    ]
    expected = llm.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert llm.encode_chat(messages) == list(expected)
    params = SamplingParams(temperature=0.0, max_tokens=5)
    (one,) = llm.chat(messages, params, use_tqdm=False)  # one conversation, or a list of them
    via_chat = llm.chat([messages, messages[1:]], params, use_tqdm=False)
    via_generate = llm.generate(
        [llm.encode_chat(messages), llm.encode_chat(messages[1:])], params, use_tqdm=False
    )
    assert [o["token_ids"] for o in via_chat] == [o["token_ids"] for o in via_generate]
    assert one["token_ids"] == via_chat[0]["token_ids"]
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}])


def test_incremental_detokenization(llm):
    """Characters split over byte tokens come out whole; spaces are kept; the pieces join to the text."""
    text = "naïve café 😀 — the end, “quoted” 42"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters take several tokens
    detok = IncrementalDetokenizer(
        llm.tokenizer, llm.tokenizer.encode("Say:", add_special_tokens=False), []
    )
    pieces = []
    for i, t in enumerate(ids):
        detok.push(t)
        detok.update(final=i == len(ids) - 1)
        pieces.append(detok.delta(finished=i == len(ids) - 1))
    assert "".join(pieces) == text
    assert (
        not any("\ufffd" in p for p in pieces) and sum(not p for p in pieces) > 0
    )  # some steps wait for more bytes


def test_engine_request_api(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    a = engine.add_request(
        random_prompts([9], seed=5)[0],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    )
    b = engine.add_request(
        random_prompts([5], seed=6)[0],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        request_id="mine",
    )
    assert b == "mine" and a != b and engine.num_waiting == 2 and engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5, 6], SamplingParams(), request_id="mine")
    with pytest.raises(ValueError, match="is empty"):
        engine.add_request([], SamplingParams())
    seen: dict[str, list[RequestOutput]] = {a: [], b: []}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id].append(out)
    assert (
        engine.num_running == 1
        and seen[b][-1].finished
        and seen[b][-1].outputs[0].finish_reason == "length"
    )
    assert [len(o.outputs[0].delta_token_ids) for o in seen[b]] == [1, 1, 1]
    assert seen[b][-1].outputs[0].token_ids == sum(
        (o.outputs[0].delta_token_ids for o in seen[b]), []
    )
    engine.abort_request(a)
    assert (
        engine.num_running == 0
        and engine.block_manager.num_free_blocks == free
        and engine.has_unfinished_requests()
    )
    (last,) = engine.step()
    assert last.request_id == a and last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) == len(seen[a]) and not engine.has_unfinished_requests()
    engine.abort_request("no-such-id")  # ignored
    assert engine.step() == []


def test_metrics_summary(llm):
    llm.generate(
        random_prompts([5, 9], seed=8),
        SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    m = llm.metrics()
    assert (
        m["requests"] >= 2 and m["generation_tokens"] >= 8 and m["generation_throughput_tok_s"] > 0
    )
    assert {"mean", "p50", "p90", "p99"} <= set(m["ttft_s"]) and m["tpot_s"]["p50"] > 0
    assert 0 < m["kv_usage_peak"] <= 1 and m["kv_usage"] == 0 and 0 <= m["prefix_hit_rate"] <= 1
    assert m["preemptions"] == 0 and m["steps"] > 0 and m["running"] == m["waiting"] == 0
