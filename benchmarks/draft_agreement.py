"""How often a draft model guesses the target's next token: the acceptance rate that greedy
speculative decoding would see, measured without the speculative engine.

    python -m benchmarks.draft_agreement --out benchmarks/results/draft_agreement_course-llama_cpu.json

The prompts are held-out stories of tools/course_model/stories.py (from story 210,000 on: the
course model trained on 0-199,999 and measured its held-out loss on 200,000-201,999; the draft
trained on fewer): a plain story's first sentence, or a chat story's request up to the
assistant's turn. The target (nanovllm_final, greedy, float32 on the CPU) writes --max-tokens
tokens after each; the draft (Hugging Face, float32) is then teacher-forced on prompt +
completion, and at every completion position its argmax is compared with the target's token.

* agreement a: the share of completion positions where the draft's argmax is the target's token.
* expected tokens per verify step for k proposals, (1 - a^(k+1)) / (1 - a): each proposal
  accepted with probability a, independently.
* replayed tokens per verify step: greedy speculation replayed on the match vector. A verify step
  at position j accepts the draft's proposals while they match (the draft proposes from an
  accepted prefix, which is the target's own text, so its proposals are the teacher-forced
  argmaxes until the first miss), at most k, plus the target's own token; the next step starts
  after them. Matches cluster (a story's fixed phrases), so this differs from the formula.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import device_name, versions  # noqa: E402
from tools.course_model import stories  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIRST_STORY = 210_000
ASSISTANT = "<|im_start|>assistant\n"


def story_prompt(text: str) -> str:
    """A chat story up to the assistant's turn; a plain story's first sentence."""
    if ASSISTANT in text:
        return text[: text.index(ASSISTANT) + len(ASSISTANT)]
    return text[: text.index(". ") + 1]


def target_completions(target: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from nanovllm_final import LLM, SamplingParams

    with LLM(target, device="cpu", dtype="float32", max_model_len=512) as llm:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
        )
    return [out["token_ids"] for out in outs]


@torch.no_grad()
def draft_matches(
    draft: Path, prompts: list[list[int]], completions: list[list[int]]
) -> list[list[bool]]:
    """Per prompt, per completion token: is it the draft's argmax after the tokens before it?"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    matches = []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0]  # (len, vocab)
        guesses = logits[len(prompt) - 1 : -1].argmax(-1)  # (len(completion),)
        matches.append((guesses == torch.tensor(completion)).tolist())
    return matches


def replayed_tokens_per_step(matches: list[list[bool]], k: int) -> float:
    """Tokens per verify step of greedy speculation with k proposals, replayed on the matches."""
    tokens = steps = 0
    for row in matches:
        j = 0
        while j < len(row):
            accepted = 0
            while accepted < k and j + accepted < len(row) and row[j + accepted]:
                accepted += 1
            advance = min(
                accepted + 1, len(row) - j
            )  # the accepted proposals and the target's token
            tokens, steps, j = tokens + advance, steps + 1, j + advance
    return tokens / steps


def expected_tokens_per_step(a: float, k: int) -> float:
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def measure(target: Path, draft: Path, num_prompts: int, max_tokens: int, max_k: int) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = [story_prompt(s) for s in stories.stories(num_prompts, start=FIRST_STORY)]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    start = time.perf_counter()
    completions = target_completions(target, prompts, max_tokens)
    matches = draft_matches(draft, prompts, completions)
    flat = [m for row in matches for m in row]
    a = sum(flat) / len(flat)
    return {
        "target": _rel(target),
        "draft": _rel(draft),
        "stories": [FIRST_STORY, FIRST_STORY + num_prompts],
        "max_tokens": max_tokens,
        "positions": len(flat),
        "agreement": round(a, 4),
        "per_prompt": [
            {"prompt": t, "agreement": round(sum(m) / len(m), 4), "tokens": len(m)}
            for t, m in zip(texts, matches)
        ],
        "by_k": [
            {
                "k": k,
                "expected_tokens_per_step": round(expected_tokens_per_step(a, k), 3),
                "replayed_tokens_per_step": round(replayed_tokens_per_step(matches, k), 3),
            }
            for k in range(1, max_k + 1)
        ],
        "seconds": round(time.perf_counter() - start, 1),
    }


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "course-llama")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "course-llama-draft")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    words = argv if argv is not None else sys.argv[1:]
    record = {
        "command": " ".join(["python -m benchmarks.draft_agreement", *words]),
        "device_name": device_name("cpu"),
        "versions": versions(),
        **measure(args.target, args.draft, args.num_prompts, args.max_tokens, args.max_k),
    }
    print(
        f"agreement {record['agreement']:.3f} over {record['positions']} positions ({args.num_prompts} prompts)"
    )
    print("k  expected  replayed  (tokens per verify step)")
    for row in record["by_k"]:
        print(
            f"{row['k']:<2} {row['expected_tokens_per_step']:8.2f}  {row['replayed_tokens_per_step']:8.2f}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
