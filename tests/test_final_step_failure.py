"""A step that raises in the final engine (a request's bad value that slipped past the
checks, a failed copy): the requests in that step end with finish_reason "error" and the
error's message, their KV blocks are freed, and the engine serves the others as if
nothing had happened. An error that loses the device stops the engine: the step raises
it, every request it held ends with an error, later calls say why; nobody waits forever.
With and without overlap."""

import pytest
import torch
from common import random_prompts

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine import llm_engine, sampling

OPTIONS = dict(device="cpu", max_model_len=64, kvcache_block_size=4)
POISON = 666  # the seed that marks the request whose sampling raises
GOOD = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def poisoned(max_tokens: int = GOOD.max_tokens) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=POISON, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def poison_sampling(monkeypatch):
    """Sampling raises, as numpy does for an out-of-range int64, for any batch holding a row of
    the poisoned request once it has `after` tokens (set the returned dict's "after")."""
    state = {"after": 0, "raised": 0}
    real = llm_engine.build_sampling_batch

    def build(seqs, eos_token_ids, columns=None):
        if any(s.params.seed == POISON and s.num_completion_tokens >= state["after"] for s in seqs):
            state["raised"] += 1
            raise OverflowError("Python int too large to convert to C long")
        return real(seqs, eos_token_ids, columns)

    monkeypatch.setattr(llm_engine, "build_sampling_batch", build)
    return state


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "sequential"])
def llm(model_dir, request):
    with LLM(model_dir("qwen3"), overlap_scheduling=request.param, **OPTIONS) as llm:
        yield llm


def drain(engine, max_steps: int = 300) -> dict:
    """Step until nothing is left; the final output of every request."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_all_free(engine) -> None:
    assert not engine.has_unfinished_requests() and engine.in_flight is None
    assert (
        engine.num_free_blocks == engine.num_blocks
        and engine.num_running == engine.num_waiting == 0
    )


def test_the_failed_steps_requests_end_with_an_error_and_the_engine_goes_on(llm, poison_sampling):
    prompts = random_prompts([5, 9, 7], seed=1)
    expected = [o["token_ids"] for o in llm.generate(prompts, GOOD, use_tqdm=False)]
    engine = llm.engine
    bad = engine.add_request(prompts[0], poisoned())
    beside = engine.add_request(prompts[1], GOOD)  # in the same step as the poisoned one
    finals = drain(engine)
    assert poison_sampling["raised"] == 1
    for rid in (bad, beside):
        assert finals[rid].outputs[0].finish_reason == "error"
        assert finals[rid].error == "OverflowError: Python int too large to convert to C long"
    assert_all_free(engine)
    assert [
        o["token_ids"] for o in llm.generate(prompts, GOOD, use_tqdm=False)
    ] == expected  # served as before


def test_a_failure_mid_run_frees_the_blocks_of_a_request_in_flight(llm, poison_sampling):
    """The poisoned request fails after some tokens (with overlap: a step of it on the device)."""
    poison_sampling["after"] = 3
    prompts = random_prompts([6, 11], seed=2)
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = llm.generate(prompts[1:], long, use_tqdm=False)[0]["token_ids"]
    outs = llm.generate(
        prompts, [poisoned(12), long], use_tqdm=False
    )  # returns: nobody waits for the failed one
    assert [o["finish_reason"] for o in outs] == ["error", "error"]
    # the tokens it had when its step failed; with overlap the third was still on the device
    assert len(outs[0]["token_ids"]) == (2 if llm.engine.overlap else 3)
    assert_all_free(llm.engine)
    assert llm.generate(prompts[1:], long, use_tqdm=False)[0]["token_ids"] == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
def test_requests_outside_the_failed_step_complete_unharmed(model_dir, poison_sampling, overlap):
    """One sequence per step: the requests before and after the poisoned one never share its step."""
    prompts = random_prompts([7, 5, 9], seed=3)
    with LLM(model_dir("qwen3"), overlap_scheduling=overlap, max_num_seqs=1, **OPTIONS) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, GOOD, use_tqdm=False)]
        engine = llm.engine
        ids = [engine.add_request(p, poisoned() if i == 1 else GOOD) for i, p in enumerate(prompts)]
        finals = drain(engine)
        assert [finals[rid].outputs[0].finish_reason for rid in ids] == [
            "length",
            "error",
            "length",
        ]
        assert [finals[rid].outputs[0].token_ids for rid in (ids[0], ids[2])] == [
            expected[0],
            expected[2],
        ]
        assert finals[ids[0]].error is None and finals[ids[2]].error is None
        assert_all_free(engine)


def test_a_failed_copy_to_the_host_ends_that_steps_requests(llm, monkeypatch):
    prompts = random_prompts([8, 4], seed=4)
    expected = [o["token_ids"] for o in llm.generate(prompts, GOOD, use_tqdm=False)]
    calls, result = [0], sampling.PendingSample.result

    def fail_third(self):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the copy to the host failed")
        return result(self)

    monkeypatch.setattr(sampling.PendingSample, "result", fail_third)
    outs = llm.generate(prompts, GOOD, use_tqdm=False)
    assert [o["finish_reason"] for o in outs] == ["error", "error"]
    assert all(len(o["token_ids"]) == 2 for o in outs)  # the third step's tokens never arrived
    assert_all_free(llm.engine)
    assert [o["token_ids"] for o in llm.generate(prompts, GOOD, use_tqdm=False)] == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
def test_a_lost_device_ends_every_request_and_stops_the_engine(model_dir, monkeypatch, overlap):
    prompts = random_prompts([5, 6, 7], seed=5)
    with LLM(model_dir("qwen3"), overlap_scheduling=overlap, max_num_seqs=2, **OPTIONS) as llm:
        engine, runner = llm.engine, llm.engine.model_runner
        ids = [
            engine.add_request(p, GOOD) for p in prompts
        ]  # the third one waits: two sequences a step
        for _ in range(3):
            engine.step()
        real = runner.execute

        def lost(step, **kw):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(runner, "execute", lost)
        with pytest.raises(
            torch.AcceleratorError, match="illegal memory access"
        ):  # the step that met it says so
            engine.step()
        finals = drain(engine)  # then every request it held ends
        assert sorted(finals) == sorted(ids)  # the waiting one too
        assert all(
            out.outputs[0].finish_reason == "error" and "illegal memory access" in out.error
            for out in finals.values()
        )
        assert_all_free(engine)
        monkeypatch.setattr(runner, "execute", real)
        with pytest.raises(
            RuntimeError,
            match="the engine stopped earlier: AcceleratorError: .*illegal memory access",
        ):
            llm.generate(prompts[:1], GOOD, use_tqdm=False)
