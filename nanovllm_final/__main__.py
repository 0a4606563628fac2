"""Command line: python -m stages.<stage> --model DIR --prompt "..." """

import argparse

from . import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="NEW in 07: ranks (devices) to split the model over")
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")


def run(args: argparse.Namespace) -> None:
    with LLM(args.model, device=args.device, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size) as llm:
        prompts = args.prompt
        if args.chat:
            prompts = [
                llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                for p in prompts
            ]
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        for prompt, out in zip(args.prompt, llm.generate(prompts, params, use_tqdm=False)):
            print(f"### {prompt}\n{out['text']}\n")


if __name__ == "__main__":
    main()
