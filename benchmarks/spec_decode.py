"""Speculative decoding: tokens/s against acceptance, and a verify step against a decode step.

Random weights accept nothing meaningful, so on a random-weight shape the proposals come from a
replay proposer (benchmark-only, engine/proposers.py's ReplayProposer): it proposes the target's
own greedy continuation from a run without speculation, each token replaced by a wrong one with
probability 1 - acceptance. "none" proposes nothing (n-gram lookup that finds nothing: the cost
of speculation that cannot win); "ngram" is real prompt lookup on the same prompts.

    # one GPU, the Qwen3-0.6B and 8B shapes:
    python -m benchmarks.spec_decode --shape qwen3-0.6b --batches 1 8 --ks 1 2 3 4 5 6 7 8 --accept 1.0 0.5 0.0 \\
        --out benchmarks/results/spec_decode_qwen3-0.6b_h200.json
    python -m benchmarks.spec_decode --shape qwen3-8b --batches 1 8 --ks 1 2 4 8 --accept 1.0 0.5 0.0 \\
        --out benchmarks/results/spec_decode_qwen3-8b_h200.json
    # a trained model and its draft, on the course stories (CPU or GPU):
    python -m benchmarks.spec_decode --model models/course-llama --draft models/course-llama-draft --device cpu \\
        --workload stories --batches 1 8 64 --ks 2 4 6 --accept --repeat 9 --max-tokens 128 \\
        --out benchmarks/results/spec_decode_course-llama_cpu.json
    # the same with --workload repeat (prompts that quote a held-out passage and ask for it again):
    #   --out benchmarks/results/spec_decode_repeat_course-llama_cpu.json

Each row: output tokens/s of greedy requests (ignore_eos) with speculation, against the same
requests without it (overlap scheduling on, the engine's default; and off, as speculation runs),
timed in turns with it (--repeat rounds of one run each, the median kept: a shared machine's
drift hits all three alike), the speedup against the faster of those two, the mean tokens a
verification emits, and the median step times (a verify step of batch x (k+1) tokens against a decode step of batch tokens).
`same_tokens` compares with plain decoding: in float32 it holds; in bf16 on random weights a
verify step's differently rounded logits can flip a near-tie, so replay rows use the speculative
engine's own greedy output (`fixed_point`) and may read False."""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.run import command_line, device_name, model_for_shape, versions, write_json
from nanovllm_final import LLM, SamplingParams
from nanovllm_final.engine.proposers import ReplayProposer


def story_prompts(count: int, words: int = 12) -> list[str]:
    """The opening words of held-out course stories."""
    from tools.course_model.stories import stories

    return [" ".join(s.split()[:words]) for s in stories(count, start=300_000)]


def repeat_prompts(count: int, words: int = 60) -> list[str]:
    """A chat request that quotes a passage of a held-out course story (its first `words` words)
    and asks for the story again: what the model writes can be looked up in its own prompt."""
    from tools.course_model.stories import stories

    return [
        f"<|im_start|>user\nTell this story again: {' '.join(s.split()[:words])}<|im_end|>\n<|im_start|>assistant\n"
        for s in stories(count, start=300_000)
    ]


WORKLOADS = {"stories": story_prompts, "repeat": repeat_prompts}


def timed_runs(
    llms: dict[str, LLM], prompts, params: SamplingParams, repeat: int, cold=()
) -> dict[str, dict]:
    """The engines named in `cold` warm up; then `repeat` rounds in which every engine generates
    once, in turn, so that a drift of a shared machine's speed hits them alike. Per engine: the
    median round's seconds, its outputs, the steps and metrics of its timed runs."""
    for name in cold:
        llms[name].generate(prompts, params, use_tqdm=False)
    for llm in llms.values():
        llm.engine.reset_metrics()
    times, outs = {name: [] for name in llms}, {}
    for _ in range(repeat):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs[name] = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
    return {
        name: {
            "outs": outs[name],
            "seconds": statistics.median(times[name]),
            "tokens": sum(len(o["token_ids"]) for o in outs[name]),
            "steps": list(llm.stats),
            "metrics": llm.metrics(),
        }
        for name, llm in llms.items()
    }


def repeats(options: dict) -> int:
    """Timed runs per row: --repeat at batch 1, fewer at larger batches (ceil(repeat / batch))."""
    return -(-options["repeat"] // options["max_num_seqs"])


def median_ms(steps: list[dict], num_tokens: int) -> float | None:
    times = [s["seconds"] for s in steps if s["num_tokens"] == num_tokens]
    return statistics.median(times) * 1e3 if times else None


def engine_options(options: dict) -> dict:
    return {key: value for key, value in options.items() if key != "repeat"}


def fixed_point(
    llm: LLM, prompts, params, runs: list[list[int]], vocab: int, tries: int = 40
) -> list[list[int]]:
    """Runs that a replay at acceptance 1 reproduces. In bf16 a verify step's wider matrix products
    round differently from a decode step's, so on random weights (near-tied logits) its greedy
    tokens can part from plain decoding's; replaying its own output makes every proposal right.
    A token can also depend on which tokens share its verify step (the decode kernel's split-K cut
    follows a step's first query), so a replay of one run's output, verified in other groups, can
    part from it again; each try keeps every group before the first parting, so the runs settle
    within a try or so per verify step (`tries` bounds them)."""
    for _ in range(tries):
        llm.engine.speculator.proposer = ReplayProposer(runs, 1.0, vocab, seed=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        again = [o["prompt_token_ids"] + o["token_ids"] for o in outs]
        if again == runs:
            break
        runs = again
    return runs


def speculative_runs(
    path, prompts, params, options: dict, spec: dict, proposals: list, plains: dict
) -> list:
    """One engine for this k; each (name, replay, acceptance) in proposals swaps its proposer and is
    timed in turns with the plain engines (`plains`).

    replay None keeps the engine's own proposer; a list of runs is the benchmark-only replay."""
    runs = []
    with LLM(path, speculative_config=spec, **engine_options(options)) as llm:
        own, vocab = llm.engine.speculator.proposer, llm.engine.model_config.vocab_size
        replay = next((r for _, r, _ in proposals if r), None)
        if (
            replay is not None
        ):  # the verify step's own greedy tokens, which may differ in the last bits
            replay = fixed_point(llm, prompts, params, replay, vocab)
            proposals = [(name, replay if r else r, a) for name, r, a in proposals]
        for name, replay, accept in proposals:
            llm.engine.speculator.proposer = (
                own if replay is None else ReplayProposer(replay, accept, vocab, seed=0)
            )
            timed = timed_runs(
                {**plains, "spec": llm}, prompts, params, repeats(options), cold=["spec"]
            )
            runs.append((name, accept if name == "replay" else None, timed))
    return runs


def row(timed: dict, batch: int, k: int, method: str, accept: float | None) -> dict:
    """A row from one set of turns: the speculative engine against the faster of plain decoding with
    and without overlap scheduling, timed in the same turns."""
    run, fast, slow = timed["spec"], timed["plain"], timed["plain_no_overlap"]
    m, tok_s = run["metrics"], run["tokens"] / run["seconds"]
    plain_tok_s, no_overlap_tok_s = (
        fast["tokens"] / fast["seconds"],
        slow["tokens"] / slow["seconds"],
    )
    verify_ms, decode_ms = median_ms(run["steps"], batch * (k + 1)), median_ms(slow["steps"], batch)
    same = [o["token_ids"] for o in run["outs"]] == [o["token_ids"] for o in fast["outs"]]
    out = {
        "batch": batch,
        "k": k,
        "method": method,
        "replay_accept": accept,
        "tok_s": tok_s,
        "plain_tok_s": plain_tok_s,
        "plain_tok_s_no_overlap": no_overlap_tok_s,
        "speedup": tok_s / max(plain_tok_s, no_overlap_tok_s),
        "acceptance_rate": m.get("spec_decode_acceptance_rate"),
        "mean_acceptance_length": m.get("spec_decode_mean_acceptance_length"),
        "verify_ms": verify_ms,
        "decode_ms": decode_ms,
        "verify_over_decode": verify_ms / decode_ms if verify_ms and decode_ms else None,
        "same_tokens": same,
    }
    print(
        f"batch {batch:3d} k {k} {method:>11} {'' if accept is None else accept:>4}: {tok_s:9.1f} tok/s "
        f"(plain {max(plain_tok_s, no_overlap_tok_s):8.1f}, x{out['speedup']:.2f}), "
        f"accepted {out['acceptance_rate'] or 0:.2f}, "
        f"mean length {out['mean_acceptance_length'] or 0:.2f}, verify/decode "
        f"{out['verify_over_decode'] or float('nan'):.2f}, same tokens {same}",
        flush=True,
    )
    return out


def run_batch(path, args, batch: int, options: dict) -> list[dict]:
    if args.model:
        prompts = WORKLOADS[args.workload](batch)
    else:
        g, vocab = (
            torch.Generator().manual_seed(batch),
            min(10000, json.loads((Path(path) / "config.json").read_text())["vocab_size"]),
        )
        prompts = [
            torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)
        ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    with contextlib.ExitStack() as stack:
        plains = {
            name: stack.enter_context(
                LLM(path, overlap_scheduling=overlap, **engine_options(options))
            )
            for name, overlap in (("plain", True), ("plain_no_overlap", False))
        }
        base = timed_runs(plains, prompts, params, 1, cold=list(plains))["plain"]
        runs = [o["prompt_token_ids"] + o["token_ids"] for o in base["outs"]]
        for k in args.ks:
            ngram = {"method": "ngram", "num_speculative_tokens": k}
            proposals = [("ngram", None, 0), ("none", [], 0)] + [
                ("replay", runs, a) for a in args.accept
            ]
            measured = speculative_runs(path, prompts, params, options, ngram, proposals, plains)
            if args.draft:
                draft = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": k}
                measured += speculative_runs(
                    path, prompts, params, options, draft, [("draft_model", None, 0)], plains
                )
            rows += [row(timed, batch, k, name, accept) for name, accept, timed in measured]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape",
        default="qwen3-0.6b",
        help="random weights of this shape (benchmarks/run.py SHAPES)",
    )
    parser.add_argument(
        "--model", help="a checkpoint instead (its prompts: course stories' openings)"
    )
    parser.add_argument("--draft", help="a draft checkpoint: adds method draft_model")
    parser.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="stories",
        help="a checkpoint's prompts: the openings of held-out course stories, or a request to repeat a quoted passage",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--accept",
        type=float,
        nargs="*",
        default=[1.0, 0.5, 0.0],
        help="replay acceptance rates (none: no replay rows)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed runs per row at batch 1 (the median is kept); batch b: ceil(repeat / b)",
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out")
    args = parser.parse_args()
    path = args.model or str(model_for_shape(args.shape, args.device))
    rows = []
    prompt_len = max(
        args.prompt_len, 128 if args.workload == "repeat" else 0
    )  # a quoted passage: about 100
    for batch in args.batches:
        options = dict(
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=batch,
            repeat=args.repeat,
            max_model_len=prompt_len + args.max_tokens + max(args.ks) + 64,
        )
        rows += run_batch(path, args, batch, options)
        record = {
            "benchmark": "spec_decode",
            "model": args.model or args.shape,
            "draft": args.draft,
            "workload": args.workload if args.model else "random",
            "device_name": device_name(args.device),
            "max_tokens": args.max_tokens,
            "rows": rows,
            "command": command_line("benchmarks.spec_decode", sys.argv[1:]),
            "versions": versions(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if args.out:  # after every batch, so a run cut short keeps what it measured
            write_json([record], args.out)


if __name__ == "__main__":
    main()
