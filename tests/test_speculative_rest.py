"""Speculation and overlap scheduling taking turns (nanovllm_final/engine/speculator.py): a
look that proposes nothing, or a verify step that leaves too few proposals accepted, rests the
proposer for 1, 2, 4, ... up to MAX_REST steps, which run overlapped; a look that proposes ends
the rest; the tokens are those of plain decoding."""

import pytest
from common import random_prompts

from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine.proposers import ReplayProposer
from nanovllm_final.engine.speculator import ACCEPTED_WEIGHT, MAX_REST, MIN_ACCEPTED
from tools.tiny_model import build_if_missing

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_if_missing(tmp_path_factory.mktemp("rest") / "qwen3", shape="tiny", arch="qwen3")


class Counting:
    """A proposer that records the steps it is asked at, proposing what `inner` proposes from
    its `start`-th look on (nothing before)."""

    def __init__(self, inner, start: int = 0):
        self.inner, self.start, self.looks = inner, start, 0

    def propose(self, seqs, ks):
        if not seqs:  # no sequence decodes with room for a proposal
            return []
        self.looks += 1
        if self.looks <= self.start:
            return [[] for _ in seqs]
        return self.inner.propose(seqs, ks)


def generate(path, prompts, proposer=None, **options):
    """(token ids, metrics, launches that found the step before still in flight)."""
    spec = SPEC if proposer is not None else None
    with LLM(path, device="cpu", speculative_config=spec, max_model_len=128, **options) as llm:
        engine = llm.engine
        if proposer is not None:
            engine.speculator.proposer = proposer
        overlapped, launch = 0, engine._launch

        def counting_launch(prev):
            nonlocal overlapped
            overlapped += prev is not None
            return launch(prev)

        engine._launch = counting_launch
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [o["token_ids"] for o in outs], llm.metrics(), overlapped


def dry_looks(steps: int) -> int:
    """Looks in `steps` decode steps when every look is dry: after the n-th, a rest of
    min(2^(n-1), MAX_REST) steps."""
    looks, step, rest = 0, 0, 1
    while step < steps:
        looks, step, rest = looks + 1, step + 1 + rest, min(2 * rest, MAX_REST)
    return looks


def test_dry_looks_rest_and_the_rests_run_overlapped(model):
    prompts = random_prompts([7], seed=3)
    plain, _, plain_overlapped = generate(model, prompts)
    dry = Counting(ReplayProposer([], 1.0, 2))  # proposes nothing
    tokens, metrics, overlapped = generate(model, prompts, dry)
    assert tokens == plain and metrics["spec_decode_num_draft_tokens"] == 0
    # 60 tokens: the prompt's step, then 59 decode steps, the first 58 with room for proposals
    assert dry.looks == dry_looks(58) == 7
    assert plain_overlapped - overlapped == dry.looks  # only a look's step completes first


def test_a_look_that_proposes_ends_the_rest(model):
    prompts = random_prompts([7, 9], seed=4)
    plain, _, _ = generate(model, prompts)
    runs = [p + t for p, t in zip(prompts, plain)]
    late = Counting(ReplayProposer(runs, 1.0, 2), start=4)  # dry for 4 looks, then right
    tokens, metrics, overlapped = generate(model, prompts, late)
    assert tokens == plain
    # 4 dry looks and their rests (1 + 2 + 4 + 8 steps) take decode steps 1-19: 20 tokens each
    # with the prompt's; the 5th look proposes, and every step from there emits 3 accepted + 1
    assert metrics["spec_decode_num_accepted_tokens"] == metrics["spec_decode_num_draft_tokens"]
    assert metrics["spec_decode_num_accepted_tokens"] == 2 * (60 - 20) // 4 * 3
    assert overlapped == 15  # the rests alone ran overlapped


def test_without_overlap_the_proposer_looks_every_step(model):
    prompts = random_prompts([7], seed=3)
    dry = Counting(ReplayProposer([], 1.0, 2))
    tokens, _, overlapped = generate(model, prompts, dry, overlap_scheduling=False)
    assert dry.looks == 58 and overlapped == 0


def rejected_looks(steps: int) -> tuple[int, int]:
    """(looks, rests) in `steps` decode steps when every proposal is rejected: each look
    verifies, and once the average of accepted proposals falls below MIN_ACCEPTED each look rests
    the proposer as a dry one does."""
    looks, rests, step, accepted = 0, 0, 0, 1.0
    while step < steps:
        looks, step = looks + 1, step + 1
        accepted -= ACCEPTED_WEIGHT * accepted
        if accepted < MIN_ACCEPTED:
            rests += 1
            step += min(2 ** (rests - 1), MAX_REST)
    return looks, rests


def test_looks_whose_proposals_are_rejected_rest(model):
    prompts = random_prompts([7], seed=3)
    plain, _, plain_overlapped = generate(model, prompts)
    runs = [p + t for p, t in zip(prompts, plain)]
    wrong = Counting(ReplayProposer(runs, 0.0, 2))  # every proposal a wrong token
    tokens, metrics, overlapped = generate(model, prompts, wrong)
    assert tokens == plain
    assert metrics["spec_decode_num_accepted_tokens"] == 0
    looks, rests = rejected_looks(58)  # 58 decode steps would verify without rests
    assert wrong.looks == looks == 9 and rests == 7
    assert metrics["spec_decode_num_drafts"] == wrong.looks
    # a look's step is launched after the step before completes, and so is the rest after it
    assert plain_overlapped - overlapped == looks + rests


def test_accepted_proposals_keep_the_proposer_looking(model):
    prompts = random_prompts([7, 9], seed=4)
    plain, _, _ = generate(model, prompts)
    runs = [p + t for p, t in zip(prompts, plain)]
    right = Counting(ReplayProposer(runs, 1.0, 2))
    tokens, metrics, overlapped = generate(model, prompts, right)
    assert tokens == plain and overlapped == 0  # every step verified: none rested
    assert metrics["spec_decode_num_accepted_tokens"] == metrics["spec_decode_num_draft_tokens"]


def test_a_request_after_a_pause_looks_at_once(model):
    """The rest and the average are the engine's while requests run; a request that arrives at an
    idle engine starts them afresh, and so gets the same looks as on a fresh engine."""
    prompts = random_prompts([7], seed=3)
    plain, _, _ = generate(model, prompts)
    runs = [p + t for p, t in zip(prompts, plain)]
    with LLM(model, device="cpu", speculative_config=SPEC, max_model_len=128) as llm:
        speculator = llm.engine.speculator
        speculator.proposer = ReplayProposer([], 1.0, 2)  # proposes nothing: a long dry spell
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert speculator.dry == dry_looks(58) and speculator.accepted == 1.0
        right = speculator.proposer = Counting(ReplayProposer(runs, 1.0, 2))
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        metrics = llm.metrics()
    assert [o["token_ids"] for o in outs] == plain
    # every decode step from the first verified: 3 accepted + 1 per step over 59 tokens
    assert right.looks == -(-59 // 4)
    assert metrics["spec_decode_num_accepted_tokens"] == metrics["spec_decode_num_draft_tokens"]
