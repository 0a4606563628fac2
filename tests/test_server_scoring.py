"""Scoring through the server on the course model: `echo` with logprobs (the prompt's joined to
the completion's, one entry per token, equal to Hugging Face's log_softmax), max_tokens 0 with
echo, vLLM's prompt_logprobs field, top_logprobs holding the chosen token, the tokenizer
endpoints; and lm-evaluation-harness (`local-completions`) running a multiple-choice and a
generate_until task written here (tests/data/story_tasks), its accuracy equal to the one
Hugging Face's logprobs of the same choices give."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from common import ROOT
from server_harness import NAME, ServerProcess, get, post
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.xdist_group("processes")
COURSE_MODEL = ROOT / "models" / "course-llama"
TASKS = ROOT / "tests" / "data" / "story_tasks"
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        COURSE_MODEL, tmp_path_factory.mktemp("scoring") / "server.log", "--dtype", "float32"
    )
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.output()


@pytest.fixture(scope="module")
def hf():
    model = AutoModelForCausalLM.from_pretrained(COURSE_MODEL, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(COURSE_MODEL)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(
            model(torch.tensor([ids])).logits[0].float(), dim=-1
        )  # (tokens, vocab)


PROMPT = "Once upon a time, in a small village by the sea, there lived a kind boy named Max."


def test_echo_joins_prompt_and_completion_logprobs(server, hf):
    model, tokenizer = hf
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    status, body = post(
        server.base + "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": 2,
            "echo": True,
            "prompt_logprobs": 1,
        },
    )
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    generated = tokenizer.encode(choice["text"][len(PROMPT) :], add_special_tokens=False)
    assert choice["text"].startswith(PROMPT) and body["usage"]["completion_tokens"] == 3
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 3
    assert (
        lp["token_logprobs"][0] is None
        and lp["top_logprobs"][0] is None
        and lp["text_offset"][0] == 0
    )
    ref = hf_logprobs(model, ids + generated[:3])
    for p in range(1, len(ids) + 3):
        token = (ids + generated)[p]
        assert abs(lp["token_logprobs"][p] - ref[p - 1, token].item()) < TOL, f"position {p}"
        top = lp["top_logprobs"][p]
        assert (
            tokenizer.decode([token]) in top and 2 <= len(top) <= 3
        )  # the chosen token, and the top 2
    # vLLM's prompt_logprobs: per prompt token, the token itself and the top 1
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        assert abs(scored[p][str(ids[p])]["logprob"] - ref[p - 1, ids[p]].item()) < TOL


def test_score_only_and_token_prompts(server, hf):
    """max_tokens 0 with echo: the prompt alone, one entry per prompt token; a batch of token-id prompts."""
    model, tokenizer = hf
    prompts = [
        tokenizer.encode(text, add_special_tokens=False)
        for text in (PROMPT, "He had many friends.")
    ]
    body = {"prompt": prompts, "max_tokens": 0, "logprobs": 0, "echo": True}
    status, body = post(server.base + "/v1/completions", body)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 0
    for ids, choice in zip(prompts, sorted(body["choices"], key=lambda c: c["index"])):
        assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids)
        ref = hf_logprobs(model, ids)
        assert all(
            abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < TOL
            for p in range(1, len(ids))
        )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "stream": True}, "echo"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_scoring_refusals(server, body, param):
    status, reply = post(server.base + "/v1/completions", {"prompt": PROMPT, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_tokenizer_endpoints(server, hf):
    status, text = get(server.base + "/tokenizer_info")
    info = json.loads(text)
    assert (
        status == 200 and info["eos_token"] == hf[1].eos_token and info["model_max_length"] == 1024
    )
    status, body = post(server.base + "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0
    status, back = post(server.base + "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPT
    assert post(server.base + "/detokenize", {"tokens": [10**6]})[0] == 400


def hf_choice_scores(model, tokenizer) -> tuple[list[list[float]], list[int]]:
    """Per story_choice item, each choice's loglikelihood from Hugging Face's logprobs, the
    harness's way (context and " " + choice encoded together, the continuation the tokens past
    the context's); and the labels."""
    items = [json.loads(line) for line in (TASKS / "story_choice.jsonl").read_text().splitlines()]
    scores = []
    for item in items:
        context = tokenizer.encode(item["context"], add_special_tokens=False)
        scores.append([])
        for choice in item["choices"]:
            whole = tokenizer.encode(item["context"] + " " + choice, add_special_tokens=False)
            lp = hf_logprobs(model, whole)
            scores[-1].append(
                sum(lp[p - 1, whole[p]].item() for p in range(len(context), len(whole)))
            )
    return scores, [item["label"] for item in items]


def test_lm_eval_harness(server, hf, tmp_path):
    """The harness tokenizes through the server (/tokenizer_info, /tokenize), scores every choice
    with echo, and generates with stop strings."""
    args = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        f"model={NAME},base_url={server.base}/v1/completions,num_concurrent=1,max_retries=1",
        "--tasks",
        "story_choice,story_next",
        "--include_path",
        str(TASKS),
        "--output_path",
        str(tmp_path),
        "--log_samples",
    ]
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert (
        "Using remote tokenizer" in run.stdout + run.stderr
    )  # /tokenizer_info and /tokenize answered
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]
    print({task: {k: v for k, v in r.items() if "," in k} for task, r in results.items()})
    scores, labels = hf_choice_scores(*hf)
    lines = next(tmp_path.rglob("samples_story_choice_*.jsonl")).read_text().splitlines()
    samples = [json.loads(line) for line in lines]
    for sample in samples:
        ours = [float(resp[0][0]) for resp in sample["resps"]]
        assert max(abs(a - b) for a, b in zip(ours, scores[sample["doc_id"]])) < TOL, sample[
            "doc_id"
        ]
    hf_accuracy = sum(
        max(range(len(s)), key=s.__getitem__) == label for s, label in zip(scores, labels)
    ) / len(labels)
    assert results["story_choice"]["acc,none"] == hf_accuracy
    assert len(samples) == len(labels) and "exact_match,strip" in results["story_next"]
