"""Overlap scheduling in the final engine: step N+1 is scheduled and launched before the
host has seen step N's tokens. Whatever the engine does that way must give the same
tokens as completing every step first (`overlap_scheduling=False`), leak no KV block, and
really launch ahead."""

import pytest
from common import random_prompts

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine import sampling

OPTIONS = dict(device="cpu", max_model_len=96, kvcache_block_size=4)


@pytest.fixture(scope="module")
def pair(model_dir):
    """Two engines on the same weights, overlapping and not."""
    path = model_dir("qwen3")
    with (
        LLM(path, overlap_scheduling=True, **OPTIONS) as on,
        LLM(path, overlap_scheduling=False, **OPTIONS) as off,
    ):
        yield on, off


def tokens(llm, prompts, params) -> list[list[list[int]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c["token_ids"], c["finish_reason"]) for c in out["outputs"]] for out in outs]


def tokens_fed(llm, prompts, params) -> int:
    """Tokens the model ran over in one generate."""
    before = len(llm.stats)
    llm.generate(prompts, params, use_tqdm=False)
    return sum(s["num_tokens"] for s in llm.stats[before:])


def assert_no_leak(llm):
    engine = llm.engine
    assert engine.in_flight is None and not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_blocks


def stop_ids(llm, prompts) -> list[int]:
    """Token ids the greedy runs produce early, so that stopping on them ends sequences mid-run."""
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    return sorted({out["token_ids"][3] for out in outs[:3]})


CASES = {
    "greedy": lambda stop: SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    "seeded": lambda stop: SamplingParams(
        temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True
    ),
    "stop ids": lambda stop: SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=stop),
    "min_tokens": lambda stop: SamplingParams(
        temperature=0.0, max_tokens=20, min_tokens=6, stop_token_ids=stop
    ),
    "penalties": lambda stop: SamplingParams(
        temperature=0.0,
        max_tokens=20,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        ignore_eos=True,
    ),
    "n=3 seeded": lambda stop: SamplingParams(
        n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True
    ),
    "logprobs": lambda stop: SamplingParams(
        temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True
    ),
    "max_model_len": lambda stop: SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
    "one token, n=2": lambda stop: SamplingParams(
        n=2, temperature=1.0, seed=1, max_tokens=1, ignore_eos=True
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_overlap_gives_the_same_tokens(pair, case):
    on, off = pair
    prompts = random_prompts([5, 30, 11, 64, 3, 17], seed=11)
    params = CASES[case](stop_ids(off, prompts))
    expected = tokens(off, prompts, params)
    assert tokens(on, prompts, params) == expected
    assert_no_leak(on)
    if case == "stop ids":
        assert any(
            c[1] == "stop" and len(c[0]) < 20 for out in expected for c in out
        )  # some stopped mid-run
    if case in (
        "greedy",
        "max_model_len",
        "one token, n=2",
    ):  # ends known in advance: no step runs in vain
        assert tokens_fed(on, prompts, params) == tokens_fed(off, prompts, params)
    if case == "max_model_len":
        assert all(
            c[1] == "length" and len(p) + len(c[0]) == OPTIONS["max_model_len"]
            for p, out in zip(prompts, expected)
            for c in out
        )


def test_overlap_logprobs_equal(pair):
    on, off = pair
    prompts = random_prompts([9, 21], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    a, b = (llm.generate(prompts, params, use_tqdm=False) for llm in (on, off))
    for x, y in zip(a, b):
        for p, q in zip(x["logprobs"], y["logprobs"]):
            assert p["token_id"] == q["token_id"] and p["logprob"] == pytest.approx(
                q["logprob"], abs=1e-5
            )


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=16, max_num_seqs=3),  # chunked prefill and a full batch
        dict(num_kvcache_blocks=24),  # preemption: the sequences outgrow the pool
    ],
)
def test_overlap_under_chunking_and_preemption(model_dir, options):
    path = model_dir("qwen3")
    prompts = random_prompts([30, 7, 41, 12, 26], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    runs = {}
    for overlap in (True, False):
        with LLM(path, overlap_scheduling=overlap, **{**OPTIONS, **options}) as llm:
            runs[overlap] = tokens(llm, prompts, params)
            assert_no_leak(llm)
            if "num_kvcache_blocks" in options:
                assert llm.engine.metrics_summary()["preemptions"] > 0
    assert runs[True] == runs[False]


def test_prefix_cache_hits_with_overlap(pair):
    on, _ = pair
    system = random_prompts([24], seed=9)[0]
    prompts = [system + tail for tail in random_prompts([3, 5, 4], seed=10)]
    on.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    outs = on.generate(prompts[1:], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert all(out["metrics"]["cached_prompt_tokens"] == 24 for out in outs)


def test_next_step_launches_before_the_last_one_is_read(pair, monkeypatch):
    """The order of events with overlap: launch 2 comes before step 1's tokens are read."""
    on, off = pair
    events = []
    for llm, name in ((on, "on"), (off, "off")):
        runner = llm.engine.model_runner
        monkeypatch.setattr(
            runner,
            "execute",
            lambda step, f=runner.execute, n=name, **kw: (
                events.append((n, "launch")),
                f(step, **kw),
            )[1],
        )
    result = sampling.PendingSample.result
    monkeypatch.setattr(
        sampling.PendingSample,
        "result",
        lambda self: (events.append((current[0], "read")), result(self))[1],
    )
    prompts = random_prompts([6, 9], seed=4)
    for llm, name in ((on, "on"), (off, "off")):
        current = [name]
        llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False
        )
    seen = {name: [e for n, e in events if n == name] for name in ("on", "off")}
    assert seen["off"][:4] == ["launch", "read", "launch", "read"]
    assert seen["on"][:3] == ["launch", "launch", "read"]


def test_abort_while_a_step_is_in_flight(pair):
    on, off = pair
    prompts = random_prompts([8, 13, 5], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = off.generate(prompts, params, use_tqdm=False)
    engine = on.engine
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    for call in range(40):
        if call == 4:
            assert engine.in_flight is not None  # the aborted request has a step on the device
            engine.abort_request(ids[1])
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert (
        finals[ids[1]].outputs[0].finish_reason == "abort"
        and len(finals[ids[1]].outputs[0].token_ids) < 12
    )
    for i in (0, 2):
        assert finals[ids[i]].outputs[0].token_ids == expected[i]["token_ids"]
    assert_no_leak(on)


def test_overlap_option_is_checked(model_dir):
    with pytest.raises(ValueError, match="overlap_scheduling must be True or False"):
        LLM(model_dir("qwen3"), device="cpu", overlap_scheduling="yes")
