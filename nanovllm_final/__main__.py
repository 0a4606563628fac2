"""nanovllm: generate text, chat, benchmark or serve with the nanovllm_final engine.

examples:
  nanovllm generate --model Qwen/Qwen3-0.6B --prompt "The capital of France is" --max-tokens 32
  nanovllm generate --model ./my-checkpoint --prompt "Hi" --prompt "Bonjour" --chat --temperature 0
  nanovllm generate --model ./my-checkpoint --prompt-file prompts.txt --n 3 --top-p 0.9 --seed 0 --json
  nanovllm chat --model Qwen/Qwen3-0.6B --system "Answer briefly." --chat-template-kwargs '{"enable_thinking": false}'
  nanovllm bench --model ./my-checkpoint --num-seqs 256 --max-input-len 1024 --max-output-len 1024
  nanovllm serve Qwen/Qwen3-0.6B --port 8000 --max-num-seqs 128   (an OpenAI-compatible server)
  nanovllm tune   (time the kernels' tiles on this GPU, write kernels/configs/<GPU>.json)

--model (serve: its first argument) takes a checkpoint directory or a hub id from the
local Hugging Face cache.
Sampling options left out take the checkpoint's generation_config.json values (as the
Python API does); `python -m nanovllm_final` is the same program. Each command's --help
lists its options.
"""

import argparse
import json
import sys
import time

from . import LLM
from .engine_flags import (
    MODEL_HELP,
    add_engine_options,
    add_sampling_options,
    engine_options,
    flag,
    sampling_params,
)
from .server.cli import add_parser as add_serve_parser
from .tune import add_parser as add_tune_parser
from .workloads import WORKLOADS, make_workload, parameters


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanovllm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{generate,chat,bench,serve,tune}"
    )
    gen = commands.add_parser(
        "generate",
        help="complete prompts and print the completions",
        description="Complete each prompt and print it with its completion(s).",
    )
    gen.set_defaults(func=run_generate)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    gen.add_argument("--prompt-file", help="a file with one prompt per line")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template (a user turn)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt (all of generate's fields)",
    )
    chat = commands.add_parser(
        "chat",
        help="talk to the model; replies are streamed",
        description="An interactive chat: type a message, the reply streams. Ctrl-D or /exit ends it, /reset forgets.",
    )
    chat.set_defaults(func=run_chat)
    chat.add_argument("--system", help="a system message to start the conversation with")
    chat.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="JSON for the chat template, e.g. '{\"enable_thinking\": false}'",
    )
    bench = commands.add_parser(
        "bench",
        help="measure throughput on random prompts (nano-vllm's benchmark)",
        description="A workload of nanovllm_final/workloads.py (default: nano-vllm's bench.py: random "
        "token-id prompts and lengths, ignore_eos); prints output tokens per second and the "
        "engine's metrics. Sampling flags apply on top of the workload's.",
    )
    bench.set_defaults(func=run_bench)
    bench.add_argument("--workload", default="nanovllm", choices=tuple(WORKLOADS))
    for name in ("num_seqs", "min_input_len", "max_input_len", "min_output_len", "max_output_len"):
        bench.add_argument(
            flag(name), type=int, help="the workload's parameter (default: the workload's)"
        )
    bench.add_argument("--workload-seed", type=int, default=0)
    bench.add_argument("--out", help="also write the result as JSON to this file")
    for sub in (gen, chat, bench):
        sub.add_argument("--model", required=True, help=MODEL_HELP)
        add_engine_options(sub)
        add_sampling_options(sub)
    add_serve_parser(commands)  # nanovllm_final/server/cli.py: its own arguments and run function
    add_tune_parser(commands)  # nanovllm_final/tune.py
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--") and argv[0] != "--help":
        argv = [
            "generate",
            *argv,
        ]  # the stages' form: python -m nanovllm_final --model DIR --prompt ...
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")


def run_generate(args: argparse.Namespace) -> None:
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    params = sampling_params(args)
    with LLM(args.model, **engine_options(args)) as llm:
        inputs = (
            [llm.encode_chat([{"role": "user", "content": p}]) for p in prompts]
            if args.chat
            else prompts
        )
        outs = llm.generate(inputs, params, use_tqdm=len(prompts) > 1)
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, **out}))
            continue
        print(f"### {prompt}")
        for c in out["outputs"]:
            print(
                c["text"] if len(out["outputs"]) == 1 else f"--- {c['finish_reason']}\n{c['text']}"
            )
        print()


def run_chat(args: argparse.Namespace) -> None:
    params = sampling_params(args, max_tokens=args.max_tokens or 1024)
    if params.n != 1:
        raise ValueError("chat streams one reply: n must be 1")
    start = [{"role": "system", "content": args.system}] if args.system else []
    with LLM(args.model, **engine_options(args)) as llm:
        messages = list(start)
        print("(Ctrl-D or /exit to leave, /reset to start over)", file=sys.stderr)
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print()
                return
            if line.strip() == "/exit":
                return
            if line.strip() == "/reset":
                messages = list(start)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            reply = []
            print("assistant> ", end="", flush=True)
            for event in llm.stream([llm.encode_chat(messages, args.chat_template_kwargs)], params):
                reply.append(event["text"])
                print(event["text"], end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})


def run_bench(args: argparse.Namespace) -> None:
    lengths = {
        k: getattr(args, k)
        for k in ("num_seqs", "min_input_len", "max_input_len", "min_output_len", "max_output_len")
    }
    overrides = {k: v for k, v in lengths.items() if v is not None} | (
        {} if args.temperature is None else {"temperature": args.temperature}
    )
    with LLM(args.model, **engine_options(args)) as llm:
        defaults = parameters(args.workload)
        if "max_input_len" in defaults:  # a prompt must leave room for one generated token
            overrides["max_input_len"] = min(
                overrides.get("max_input_len", defaults["max_input_len"]),
                llm.config.max_model_len - 1,
            )
        prompts, workload = make_workload(
            args.workload, llm.model_config.vocab_size, seed=args.workload_seed, **overrides
        )
        params = [sampling_params(args, **p) for p in workload]
        llm.generate([[1] * 16], sampling_params(args, max_tokens=4), use_tqdm=False)  # warm-up
        llm.engine.reset_metrics()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - start
        tokens = sum(len(c["token_ids"]) for o in outs for c in o["outputs"])
        result = {
            "model": llm.model_name,
            "workload": args.workload,
            "num_seqs": len(prompts),
            "output_tokens": tokens,
            "seconds": seconds,
            "output_tokens_per_s": tokens / seconds,
            "metrics": llm.metrics(),
        }
    print(f"{tokens} output tokens in {seconds:.2f} s: {tokens / seconds:,.0f} tokens/s")
    m = result["metrics"]
    if m["ttft_s"]:
        print(
            f"TTFT p50 {m['ttft_s']['p50'] * 1e3:.0f} ms, p99 {m['ttft_s']['p99'] * 1e3:.0f} ms; "
            f"TPOT p50 {m['tpot_s']['p50'] * 1e3:.1f} ms"
            if m["tpot_s"]
            else ""
        )
    print(
        f"KV usage peak {m['kv_usage_peak']:.0%}, preemptions {m['preemptions']}, prefix hit rate {m['prefix_hit_rate']:.1%}"
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
