"""Structured output in the final engine (SamplingParams.structured_outputs on xgrammar): every
output of the shared schemas, regexes and choices parses and validates, greedy and sampled,
n > 1, under preemption and prefix hits; free rows in the same batch get exactly their
unconstrained tokens; hostile grammars end their own request with a clear error only."""

import json
import re
import time

import jsonschema
import pytest
from common import ROOT, random_prompts, total

from benchmarks.structured_schemas import CHOICES, REGEXES, SCHEMAS, STORY
from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine import structured
from nanovllm_final.structured_outputs import MAX_DEPTH, StructuredOutputsParams
from nanovllm_final.validate import Problem

pytest.importorskip("xgrammar")
COURSE = ROOT / "models" / "course-llama"


@pytest.fixture(scope="module", params=["course", "qwen3"])
def llm(request, model_dir):
    path = COURSE if request.param == "course" else model_dir("qwen3")
    with LLM(path, device="cpu", max_model_len=256, kvcache_block_size=16) as engine:
        yield engine


def formats() -> list[tuple[dict, object]]:
    """(structured_outputs, check of the output text) for every shared case."""
    cases = [
        ({"json": s}, lambda text, s=s: jsonschema.validate(json.loads(text), s)) for s in SCHEMAS
    ]
    cases += [
        ({"regex": r}, lambda text, r=r: re.fullmatch(r, text) or pytest.fail(f"{text!r} !~ {r}"))
        for r in REGEXES
    ]
    cases += [
        ({"choice": c}, lambda text, c=c: text in c or pytest.fail(f"{text!r} not in {c}"))
        for c in CHOICES
    ]
    return cases


def check_all(outs: list[dict], cases: list) -> None:
    for out, (fmt, check) in zip(outs, cases):
        for completion in out["outputs"]:
            assert completion["finish_reason"] == "stop", (fmt, completion)
            check(completion["text"])


@pytest.mark.parametrize("sampled", [False, True])
def test_every_output_validates(llm, sampled):
    """All cases in one batch: greedy, or sampled with n=2 (each completion has its own matcher)."""
    cases = formats()
    extra = {"temperature": 0.9, "top_k": 50, "n": 2, "seed": 5} if sampled else {"temperature": 0}
    params = [SamplingParams(max_tokens=128, structured_outputs=fmt, **extra) for fmt, _ in cases]
    outs = llm.generate(["Once upon a time"] * len(cases), params, use_tqdm=False)
    check_all(outs, cases)


def test_free_rows_are_untouched(llm):
    """Free rows (greedy and seeded top-p) beside constrained ones get the tokens they get alone."""
    prompts = random_prompts([7, 11, 5], seed=4)
    free = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12),
        SamplingParams(temperature=1.0, seed=9, max_tokens=12),
    ]
    alone = llm.generate(prompts, free, use_tqdm=False)
    constrained = [
        SamplingParams(
            temperature=t, seed=1, max_tokens=64, structured_outputs={"json": SCHEMAS[i]}
        )
        for i, t in ((6, 0), (11, 0.7), (19, 1.0))
    ]
    mixed = llm.generate(prompts + prompts, free + constrained, use_tqdm=False)
    assert [o["token_ids"] for o in mixed[:3]] == [o["token_ids"] for o in alone]
    check_all(
        mixed[3:],
        [
            (None, lambda text, s=SCHEMAS[i]: jsonschema.validate(json.loads(text), s))
            for i in (6, 11, 19)
        ],
    )


def test_length_inside_a_structure_and_eos(llm):
    """max_tokens inside an unfinished object ends with "length"; a finished one ends on EOS ("stop")."""
    schema = {"json": STORY}
    short, full = llm.generate(
        ["A story"] * 2,
        [
            SamplingParams(temperature=0, max_tokens=3, structured_outputs=schema),
            SamplingParams(temperature=0, max_tokens=128, structured_outputs=schema),
        ],
        use_tqdm=False,
    )
    assert short["finish_reason"] == "length" and full["text"].startswith(short["text"])
    assert full["finish_reason"] == "stop" and full["token_ids"][-1] in llm.engine.eos_set
    jsonschema.validate(json.loads(full["text"]), STORY)


def test_preemption_and_prefix_hits(model_dir):
    """A KV budget too small for every sequence, and one shared prompt: outputs still validate."""
    cases = formats()[:12]
    prompt = random_prompts([20], seed=2)[0]
    with LLM(
        model_dir("qwen3"),
        device="cpu",
        max_model_len=96,
        kvcache_block_size=4,
        num_kvcache_blocks=24,
    ) as llm:
        params = [
            SamplingParams(temperature=0.7, seed=i, max_tokens=72, structured_outputs=fmt)
            for i, (fmt, _) in enumerate(cases)
        ]
        check_all(llm.generate([prompt] * len(cases), params, use_tqdm=False), cases)
        assert total(llm, "preemptions") > 0 and total(llm, "prefix_hit_tokens") > 0


def test_params_are_checked_where_they_enter():
    ok = SamplingParams(structured_outputs={"json": json.dumps(SCHEMAS[0])}).structured_outputs
    assert ok == StructuredOutputsParams(json=SCHEMAS[0])
    assert SamplingParams(
        structured_outputs='{"choice": ["a", "b"]}'
    ).structured_outputs.choice == ["a", "b"]  # the CLI's
    deep = {"type": "integer"}
    for _ in range(MAX_DEPTH + 5):
        deep = {"type": "object", "properties": {"a": deep}}
    bad = {
        "none": {},
        "two": {"regex": "a", "choice": ["a"]},
        "keyword": {"json": {"type": "array", "uniqueItems": True}},
        "deep": {"json": deep},
        "wide": {"json": {"properties": {f"p{i}": {} for i in range(10_000)}}},
        "text": {"json": "{not json"},
        "choice": {"choice": []},
        "field": {"jsonn": {}},
        "kind": 5,
        "json_object": {"json_object": "yes"},
    }
    for name, value in bad.items():
        with pytest.raises(Problem) as err:
            SamplingParams(structured_outputs=value)
        assert err.value.param == "structured_outputs", name
    with pytest.raises(Problem, match="uniqueItems"):
        SamplingParams(structured_outputs=bad["keyword"])


def test_hostile_grammars_end_only_their_request(model_dir, monkeypatch):
    """A schema the compiler refuses, a bad regex, a bad grammar, and a 1,000-property schema past
    the time limit each end with a clear error, in the same generate call as free requests,
    which get their usual tokens."""
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    recursive = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
                "required": ["next"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    hostile = {
        "unsupported type": {"json": {"type": "frob"}},
        "bad regex": {"regex": "[a-"},
        "bad grammar": {"grammar": "root ::= 'a' |"},
        "time limit": {"json": big},
    }
    prompts = random_prompts([6, 9], seed=8)
    free = [SamplingParams(temperature=0, max_tokens=16)] * 2
    with LLM(model_dir("qwen3"), device="cpu", max_model_len=256) as llm:
        alone = llm.generate(prompts, free, use_tqdm=False)
        llm.engine.grammars.timeout_s = 0.05
        start = time.perf_counter()
        params = [SamplingParams(max_tokens=8, structured_outputs=fmt) for fmt in hostile.values()]
        params.append(
            SamplingParams(temperature=0, max_tokens=256, structured_outputs={"json": recursive})
        )
        outs = llm.generate(prompts + ["x"] * len(params), free + params, use_tqdm=False)
        assert time.perf_counter() - start < 10
        assert [o["token_ids"] for o in outs[:2]] == [o["token_ids"] for o in alone]
        messages = [o.get("error") or "" for o in outs[2:-1]]
        assert all(o["finish_reason"] == "error" for o in outs[2:-1]), messages
        assert "frob" in messages[0] and "Unclosed" in messages[1] and "EBNF" in messages[2], (
            messages
        )
        assert "time limit" in messages[3], messages
        assert "/project/" not in "".join(messages)  # no compiler log prefix
        assert outs[-1]["finish_reason"] in ("stop", "length") and outs[-1]["text"].startswith(
            '{"next": '
        )


def test_without_the_extra_a_format_is_a_clear_error(model_dir, monkeypatch):
    monkeypatch.setattr(structured, "xgrammar", lambda: None)
    with LLM(model_dir("qwen3"), device="cpu", max_model_len=64) as llm:
        with pytest.raises(Problem, match=r"nanovllm-staged\[structured\]") as err:
            llm.generate(
                ["x"], SamplingParams(structured_outputs={"choice": ["a"]}), use_tqdm=False
            )
        assert err.value.param == "structured_outputs"
        assert (
            llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0]["finish_reason"]
            == "length"
        )


def test_abort_while_the_grammar_compiles(model_dir):
    """A request aborted while its grammar compiles ends with "abort" and frees nothing it never held."""
    slow = {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(900)}}
    with LLM(model_dir("qwen3"), device="cpu", max_model_len=64) as llm:
        engine = llm.engine
        rid = engine.add_request(
            [5, 6, 7], SamplingParams(max_tokens=4, structured_outputs={"json": slow})
        )
        assert engine.num_waiting == 1 and engine.num_running == 0
        engine.abort_request(rid)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert [o.outputs[0].finish_reason for o in outputs] == ["abort"]
        assert not engine.grammars.waiting  # dropped once the engine looked
        assert engine.num_free_blocks == engine.num_blocks


def test_overlap_scheduling_changes_no_token(model_dir):
    """With overlap, a step's mask is filled from the step before's tokens taken ahead of their
    resolution (Grammars.advance); without, step by step: the same tokens, sampled or greedy."""
    cases = formats()
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=96, structured_outputs=fmt)
        for i, ((fmt, _), t) in enumerate(zip(cases, [0.0, 0.8] * len(cases)))
    ]
    runs = []
    for overlap in (True, False):
        with LLM(
            model_dir("qwen3"), device="cpu", max_model_len=256, overlap_scheduling=overlap
        ) as llm:
            runs.append(
                [
                    o["token_ids"]
                    for o in llm.generate(["Once"] * len(cases), params, use_tqdm=False)
                ]
            )
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mask_kernel_equals_the_reference(dtype):
    """The Triton mask (under TRITON_INTERPRET=1 without CUDA) against apply_bitmask's PyTorch code:
    some rows constrained, in any order, a bitmask narrower than the vocabulary (the ids past it
    masked), a last word's high bits set past the vocabulary; the free rows untouched."""
    import torch

    from nanovllm_final.kernels.grammar_mask import mask_logits_

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, dtype)
    for vocab, words in ((5000, 157), (5000, 120), (70, 3)):
        logits = torch.randn(9, vocab, generator=g).to(dtype)
        rows = torch.tensor([7, 0, 3, 4])
        bitmask = torch.randint(-(2**31), 2**31, (4, words), generator=g, dtype=torch.int64).to(
            torch.int32
        )
        bitmask[1] = -1  # every token allowed (up to the bitmask's width)
        expected = structured.apply_bitmask_reference(logits, rows, bitmask)
        out = mask_logits_(logits.to(device), rows.to(device), bitmask.to(device)).cpu()
        assert torch.equal(out, expected)
        assert torch.equal(out[[1, 2, 5, 6, 8]], logits[[1, 2, 5, 6, 8]])
        assert (out[rows, min(vocab, 32 * words) :] == float("-inf")).all()
        assert torch.isfinite(out[0, : min(vocab, 32 * words)]).all()  # bitmask[1]: all allowed


def test_overlap_changes_no_token_of_a_mixed_batch(model_dir):
    """Under overlap each step's mask is filled after the step before's tokens went into the
    matchers, while the device runs the forward pass: a batch mixing constrained rows (n=2 among
    them) and free ones (greedy, seeded, top-k) gets the tokens of the engine without overlap."""
    cases = formats()[::4]
    prompts = random_prompts([5, 9, 7], seed=11)
    free = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0.9, seed=2, max_tokens=40),
        SamplingParams(temperature=0.8, seed=4, top_k=20, max_tokens=30),
    ]
    constrained = [
        SamplingParams(temperature=t, seed=i, n=1 + i % 2, max_tokens=64, structured_outputs=fmt)
        for i, ((fmt, _), t) in enumerate(zip(cases, [0.0, 0.8] * len(cases)))
    ]
    runs = []
    for overlap in (True, False):
        with LLM(
            model_dir("qwen3"), device="cpu", max_model_len=256, overlap_scheduling=overlap
        ) as llm:
            outs = llm.generate(prompts + ["Once"] * len(cases), free + constrained, use_tqdm=False)
            runs.append([[c["token_ids"] for c in o["outputs"]] for o in outs])
            check_all(outs[3:], cases)
    assert runs[0] == runs[1]


def test_a_fill_that_raises_ends_its_step_only(model_dir, monkeypatch):
    """A mask fill that raises ends its step's requests with an error; the engine serves the next
    requests as usual."""
    calls = []
    bitmask = structured.Grammars.bitmask

    def flaky(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the matcher broke")
        return bitmask(self, *args)

    monkeypatch.setattr(structured.Grammars, "bitmask", flaky)
    params = SamplingParams(temperature=0, max_tokens=32, structured_outputs={"json": STORY})
    with LLM(model_dir("qwen3"), device="cpu", max_model_len=256, overlap_scheduling=True) as llm:
        out = llm.generate(["A story"], params, use_tqdm=False)[0]
        assert out["finish_reason"] == "error" and "the matcher broke" in out["error"], out
        again = llm.generate(
            ["A story"] * 2, [params, SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False
        )
        assert again[0]["finish_reason"] in ("stop", "length") and again[0]["text"].startswith("{")
        assert again[1]["finish_reason"] == "length"


def test_a_host_mask_is_one_buffer():
    """The rows and the bitmask in one buffer, viewed back whole (as the device copy is) for any
    row and word counts: what the sampler applies is what was filled."""
    import numpy as np
    import torch

    from nanovllm_final.engine.step_input import unpack

    for num_rows, words in ((1, 1), (3, 5), (7, 16)):
        mask = structured.HostMask.allocate(num_rows, words, pin=False)
        mask.rows[:] = np.arange(num_rows)[::-1] * 2
        mask.filled.copy_(
            torch.arange(num_rows * words, dtype=torch.int32).view(num_rows, words) - 7
        )
        rows, bitmask = unpack(mask.packed.clone(), [mask.rows, mask.bitmask], [0, mask.offset])
        assert rows.tolist() == [2 * i for i in range(num_rows)][::-1]
        assert torch.equal(bitmask, mask.filled) and bitmask.dtype == torch.int32
        assert [t.tolist() for t in mask.to(torch.device("cpu"))] == [
            rows.tolist(),
            bitmask.tolist(),
        ]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_finished_grammar_ends_its_sequence_before_min_tokens(model_dir, overlap):
    """min_tokens past a choice's end: the finished grammar allows only the EOS ids, which
    min_tokens forbids, so the row has no allowed token left and draws the argmax of a row
    that is -inf everywhere, token 0 (one of the tiny model's EOS ids, [2, 0]). The sequence still ends
    ("stop") on that one token after the choice (no step runs on past the grammar), with or
    without overlap, and the same request without a grammar runs to max_tokens."""
    params = SamplingParams(
        temperature=0, max_tokens=16, min_tokens=6, structured_outputs={"choice": ["yes", "no"]}
    )
    with LLM(
        model_dir("qwen3"), device="cpu", max_model_len=256, overlap_scheduling=overlap
    ) as llm:
        out = llm.generate(["Answer:"], params, use_tqdm=False)[0]
        free_params = SamplingParams(temperature=0, max_tokens=16, min_tokens=6)
        free = llm.generate(["Answer:"], free_params, use_tqdm=False)[0]
    assert out["finish_reason"] == "stop", out
    assert llm.tokenizer.decode(out["token_ids"][:-1]) in ("yes", "no"), out
    assert len(free["token_ids"]) == 16 and free["finish_reason"] == "length", free


@pytest.mark.parametrize("num_rows", [17, 50])
def test_a_pool_fills_what_one_thread_fills(model_dir, monkeypatch, num_rows):
    """Past FILL_INLINE_ROWS rows the bitmask fills in chunks of at least that many rows on the
    pool's threads (3 here; 17 rows: 2 chunks, 50: 3 uneven ones): the rows hold what each matcher
    fills on its own, the last word's bits past the grammar's ids cleared once it is waited for."""
    import numpy as np
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("qwen3"))
    grammars = structured.Grammars(tokenizer, 1000, [tokenizer.eos_token_id or 0])
    compiled = grammars._compile(structured.Job(), StructuredOutputsParams(json=STORY))
    seqs = []
    for i in range(num_rows):  # each matcher i tokens into the grammar (its first allowed ones)
        matcher = structured.xgrammar().GrammarMatcher(compiled)
        for _ in range(i % 7):
            one = structured.HostMask.allocate(1, -(-grammars.grammar_vocab // 32), pin=False)
            matcher.fill_next_token_bitmask(one.filled, 0)
            bits = np.unpackbits(one.bitmask.view(np.uint8), bitorder="little")
            assert matcher.accept_token(int(np.flatnonzero(bits[: grammars.grammar_vocab])[0]))
        seqs.append(type("Seq", (), {"grammar": matcher, "seq_id": i})())
    monkeypatch.setattr(structured.Grammars, "fill_threads", 3)  # as on a GPU
    try:
        mask = grammars.bitmask(seqs)
        assert len(mask.pending) == min(3, -(-num_rows // structured.FILL_INLINE_ROWS))
        got = mask.wait().bitmask.copy()
    finally:
        grammars.shutdown()
    words = -(-grammars.grammar_vocab // 32)
    for row, seq in enumerate(seqs):
        alone = structured.HostMask.allocate(1, words, pin=False)
        seq.grammar.fill_next_token_bitmask(alone.filled, 0)
        if grammars.grammar_vocab % 32:
            alone.bitmask[:, -1] &= np.int32((1 << grammars.grammar_vocab % 32) - 1)
        assert (got[row] == alone.bitmask[0]).all(), row


def test_overlap_changes_no_token_of_a_large_batch(model_dir, monkeypatch):
    """40 constrained rows (their masks filled on the pool's 2 threads, as on a GPU, while the
    engine completes the step before) beside free ones: the tokens of the engine without overlap."""
    monkeypatch.setattr(structured.Grammars, "fill_threads", 2)
    cases = formats()
    prompts = random_prompts([4 + i % 5 for i in range(44)], seed=3)
    params = [
        SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=24, structured_outputs=fmt)
        for i, (fmt, _) in enumerate(cases[i % len(cases)] for i in range(40))
    ] + [SamplingParams(temperature=0.7, seed=50 + i, max_tokens=24) for i in range(4)]
    runs = []
    for overlap in (True, False):
        with LLM(
            model_dir("qwen3"), device="cpu", max_model_len=256, overlap_scheduling=overlap
        ) as llm:
            runs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
            assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert runs[0] == runs[1]


def test_a_pool_chunk_that_raises_ends_its_step_only(model_dir, monkeypatch):
    """A chunk whose fill raises on the pool's thread ends its step's requests with the error;
    the engine serves the next requests as usual."""
    xgr = structured.xgrammar()
    calls, fill = [], xgr.BatchGrammarMatcher.batch_fill_next_token_bitmask

    def flaky(self, *args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the matcher broke")
        return fill(self, *args)

    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_fill_next_token_bitmask", flaky)
    monkeypatch.setattr(structured.Grammars, "fill_threads", 2)  # the pool, as on a GPU
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"json": STORY})
    prompts = random_prompts([5] * 20, seed=1)
    with LLM(model_dir("qwen3"), device="cpu", max_model_len=256, overlap_scheduling=True) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o["finish_reason"] == "error" for o in outs), outs
        assert "the matcher broke" in outs[0]["error"]
        again = llm.generate(prompts[:18], params, use_tqdm=False)
        assert all(o["finish_reason"] in ("stop", "length") for o in again)
        assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_the_fill_threads_setting(model_dir, monkeypatch):
    """NANOVLLM_FILL_THREADS sets the pool's threads on a GPU (0: every mask on the engine's
    thread); unset, a quarter of the cores (1 to 4); a CPU engine has none; anything but a
    number of threads is an error naming the variable, at start."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir("qwen3"))
    monkeypatch.delenv("NANOVLLM_FILL_THREADS", raising=False)
    assert 1 <= structured.Grammars(tokenizer, 1000, [0]).threads <= 4
    for text, threads in (("0", 0), ("3", 3)):
        monkeypatch.setenv("NANOVLLM_FILL_THREADS", text)
        grammars = structured.Grammars(tokenizer, 1000, [0])
        grammars.device = torch.device("cuda")
        assert grammars.fill_threads == threads
        grammars.device = torch.device("cpu")
        assert grammars.fill_threads == 0
    monkeypatch.setenv("NANOVLLM_FILL_THREADS", "two")
    with pytest.raises(ValueError, match="NANOVLLM_FILL_THREADS must be a number"):
        LLM(model_dir("qwen3"), device="cpu", max_model_len=256)
