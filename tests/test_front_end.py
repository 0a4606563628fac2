"""One request front end (engine/front_end.py) for the LLM and the server: the same limits with
the same messages offline and served, chat content as text parts, numpy token ids, a tiny
top_p sampling greedily, one set of reserved template keys, the server's fields generated
from SamplingParams, and served text decoded once (in the engine process where stop strings
are matched). The server's side runs in this process: its request path (`Server.prepare`)
over a stand-in for the engine client, and the engine core's step messages over this LLM."""

import json
import types

import numpy as np
import pytest
from common import random_prompts

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine.front_end import RESERVED_TEMPLATE_KWARGS, validate_request
from nanovllm_final.server.app import Server
from nanovllm_final.server.engine_client import Choice
from nanovllm_final.server.engine_core import EngineCore
from nanovllm_final.server.protocol import (
    OPENAI_SHAPED,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
)
from nanovllm_final.validate import Problem, options

MAX_MODEL_LEN, MAX_NUM_SEQS = 64, 4
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(
        model_dir("qwen3"),
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        kvcache_block_size=4,
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    """The server's request path over this LLM's config and tokenizer (no engine process)."""
    client = types.SimpleNamespace(
        config=llm.config,
        model_config=llm.model_config,
        tokenizer=llm.tokenizer,
        in_flight=0,
        max_pending=1000,
    )
    return Server(client, ["tiny"])


def served(server, body: dict, chat: bool = False):
    """(prompt token ids, SamplingParams) as the server prepares the body, or its RequestError."""
    try:
        _, prompts, params = server.prepare(server.endpoints[chat], json.dumps(body).encode())
    except RequestError as err:
        return err
    return prompts, params


def offline(fn) -> Problem:
    with pytest.raises(Problem) as info:
        fn()
    return info.value


def test_the_same_limits_with_the_same_messages(llm, server):
    prompt = random_prompts([10], seed=1)[0]
    # n beyond max_num_seqs: refused by the LLM, the engine's API and the server alike
    params = SamplingParams(n=MAX_NUM_SEQS + 1, max_tokens=4)
    problem = offline(lambda: llm.generate([prompt], params, use_tqdm=False))
    assert offline(lambda: llm.engine.add_request(prompt, params)).message == problem.message
    err = served(server, {"prompt": prompt, "n": MAX_NUM_SEQS + 1, "max_tokens": 4})
    assert (
        (problem.message, problem.param, problem.code)
        == (err.message, err.param, err.code)
        == (
            f"n={MAX_NUM_SEQS + 1} is more than the {MAX_NUM_SEQS} sequences this engine "
            "runs at once (max_num_seqs)",
            "n",
            "invalid_value",
        )
    )
    assert not llm.engine.has_unfinished_requests()
    # a prompt plus max_tokens past max_model_len: one check, one message; the server refuses it
    # (OpenAI's contract), the LLM ends the completion at max_model_len (the staged API's)
    params = SamplingParams(max_tokens=MAX_MODEL_LEN - 9, **GREEDY)
    err = served(server, {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - 9})
    problem = validate_request(prompt, params, llm.config, llm.model_config, strict_length=True)
    assert (problem.message, problem.param, problem.code) == (
        err.message,
        err.param,
        err.code,
    ) and err.status == 400
    assert err.code == "context_length_exceeded" and err.param == "max_tokens"
    assert (
        "is 64 tokens, but 65 were asked for (10 in the prompt, 55 for the completion)"
        in err.message
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(out["token_ids"]) == MAX_MODEL_LEN - 10 and out["finish_reason"] == "length"
    # at the edge the server takes it; max_tokens unset runs to max_model_len, as offline with None
    assert (
        served(server, {"prompt": prompt, "max_tokens": MAX_MODEL_LEN - 10, "n": MAX_NUM_SEQS})[1].n
        == MAX_NUM_SEQS
    )
    assert (
        served(server, {"messages": [{"role": "user", "content": "hi"}]}, chat=True)[1].max_tokens
        is None
    )


def test_chat_takes_text_parts_offline_as_served(llm, server):
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bake bread."}]
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Bake "}, {"type": "text", "text": "bread."}],
        },
    ]
    ids = llm.encode_chat(plain)
    assert llm.encode_chat(parts) == ids == served(server, {"messages": parts}, chat=True)[0][0]
    params = SamplingParams(max_tokens=3, **GREEDY)
    assert (
        llm.chat(parts, params, use_tqdm=False)[0]["token_ids"]
        == llm.chat(plain, params, use_tqdm=False)[0]["token_ids"]
    )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    problem, err = (
        offline(lambda: llm.encode_chat(image)),
        served(server, {"messages": image}, chat=True),
    )
    assert (problem.message, problem.param) == (
        err.message,
        err.param,
    ) and "text content parts" in err.message


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_a_reserved_template_key_is_reserved_offline_and_served(llm, server, key):
    messages = [{"role": "user", "content": "hi"}]
    problem = offline(lambda: llm.encode_chat(messages, {key: None}))
    err = served(server, {"messages": messages, "chat_template_kwargs": {key: None}}, chat=True)
    assert problem.param == err.param == "chat_template_kwargs" and problem.message == err.message
    assert key in err.message


def test_numpy_token_ids_are_ints(llm):
    prompt = random_prompts([9], seed=2)[0]
    params = SamplingParams(max_tokens=4, **GREEDY)
    want = llm.generate([prompt], params, use_tqdm=False)[0]
    for given in (
        np.array(prompt, np.int32),
        np.array(prompt, np.int64),
        [np.int64(t) for t in prompt],
    ):
        out = llm.generate([given], params, use_tqdm=False)[0]
        assert out["token_ids"] == want["token_ids"] and out["prompt_token_ids"] == prompt
        assert all(type(t) is int for t in out["prompt_token_ids"])
    assert (
        offline(lambda: llm.generate([np.array(prompt, np.float32)], params, use_tqdm=False)).param
        == "prompt"
    )


def test_a_tiny_top_p_is_greedy(llm, server):
    prompts = random_prompts([5, 8, 11], seed=3)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    for top_p in (1e-9, 1e-300):  # 1e-300 is 0 in float32: the sampler floors it
        sampled = llm.generate(
            prompts,
            SamplingParams(temperature=1.0, top_p=top_p, seed=5, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        assert [o["token_ids"] for o in sampled] == [o["token_ids"] for o in greedy]
    assert served(server, {"prompt": "hi", "top_p": 1e-9})[1].top_p == 1e-9
    assert (
        offline(lambda: SamplingParams(top_p=0.0)).param
        == served(server, {"prompt": "hi", "top_p": 0.0}).param
        == "top_p"
    )


def test_request_fields_come_from_sampling_params():
    sampled = [o for o in options(SamplingParams) if o.name not in OPENAI_SHAPED]
    assert {"n", "temperature", "top_p", "stop", "min_tokens", "repetition_penalty"} <= {
        o.name for o in sampled
    }
    for request in (CompletionRequest, ChatCompletionRequest):
        for o in sampled:
            assert (
                request.model_fields[o.name].description == o.help
                and request.model_fields[o.name].default is None
            )


class NoDecoding:
    """A tokenizer for the API side that must decode nothing."""

    def decode(self, *args, **kwargs):
        raise AssertionError("the API side decoded a request whose text the engine sent")

    _tokenizer = None
    clean_up_tokenization_spaces = True


def core_run(
    llm, prompt: list[int], params: SamplingParams, tokenizer
) -> tuple[list[str], str, list[int]]:
    """The engine core's step messages for one request, handed out as the API side does:
    (the text deltas, the finish reason, the token ids)."""
    core = EngineCore(llm, None, None, None)
    assert core.add([("r", prompt, params)]) is None
    choice, deltas, ids, reason = Choice(tokenizer, prompt, params), [], [], None
    while llm.engine.has_unfinished_requests():
        for rid, items, _, _ in core.deltas(llm.engine.step()):
            for _, new_ids, text, logprobs, finish in items:
                delta, got, _, reason = choice.apply(new_ids, text, logprobs, finish)
                deltas.append(delta)
                ids += got
    return deltas, reason, ids


def test_served_text_is_decoded_once_and_stop_strings_still_cut_it(llm):
    prompt = random_prompts([6], seed=4)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0]
    text = full["text"]
    stop = next(
        text[i : i + 2]
        for i in range(4, len(text) - 2)
        if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i
    )
    params = SamplingParams(max_tokens=24, stop=[stop], **GREEDY)
    want = llm.generate([prompt], params, use_tqdm=False)[0]
    assert want["text"] == text[: text.index(stop)] and want["finish_reason"] == "stop"
    deltas, reason, ids = core_run(
        llm, prompt, params, NoDecoding()
    )  # the engine's text, and no decoding here
    assert "".join(deltas) == want["text"] and reason == "stop" and ids == want["token_ids"]
    assert sum(bool(d) for d in deltas) > 1  # it streamed, in more than one delta
    deltas, reason, ids = core_run(
        llm, prompt, SamplingParams(max_tokens=24, **GREEDY), llm.tokenizer
    )
    assert (
        "".join(deltas) == text and ids == full["token_ids"]
    )  # no stop strings: decoded on the API side
