"""Command line: python -m stages.<stage> --model DIR --prompt "..." [--engine-option VALUE ...]

Every engine option of the API (EngineConfig) and every SamplingParams field is a flag:
max_model_len is --max-model-len, enforce_eager is --enforce-eager / --no-enforce-eager.
Flags left out take the API's defaults, except --temperature: the command line is greedy (0.0).
"""

import argparse
from dataclasses import MISSING, fields

from . import LLM, SamplingParams
from .config import EngineConfig

CLI_DEFAULTS = {"temperature": 0.0}  # where the command line's default differs from the API's


def add_fields(parser: argparse.ArgumentParser, cls: type, title: str) -> list[str]:
    """One flag per field of the dataclass cls, typed by its default; returns the field names."""
    group = parser.add_argument_group(title)
    names = []
    for f in fields(cls):
        if f.default is MISSING:  # the model directory: --model, below
            continue
        default = CLI_DEFAULTS.get(f.name, f.default)
        flag, names = "--" + f.name.replace("_", "-"), names + [f.name]
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = str if default is None else type(default)
            group.add_argument(
                flag,
                type=kind,
                default=default,
                metavar=kind.__name__.upper(),
                help="default: automatic" if default is None else "default: %(default)s",
            )
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument(
        "--prompt", action="append", required=True, help="a prompt (repeat for a batch)"
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    engine_options = add_fields(parser, EngineConfig, "engine options (LLM(model, **options))")
    sampling_fields = add_fields(parser, SamplingParams, "sampling (SamplingParams)")
    args = vars(parser.parse_args(argv))
    try:
        run(
            args,
            {k: args[k] for k in engine_options},
            SamplingParams(**{k: args[k] for k in sampling_fields}),
        )
    except (ValueError, FileNotFoundError) as err:
        parser.exit(2, f"error: {err}\n")


def run(args: dict, engine_options: dict, params: SamplingParams) -> None:
    with LLM(args["model"], **engine_options) as llm:
        prompts = args["prompt"]
        if args["chat"]:
            prompts = [
                llm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]
        for prompt, out in zip(args["prompt"], llm.generate(prompts, params, use_tqdm=False)):
            print(f"### {prompt}\n{out['text']}\n")


if __name__ == "__main__":
    main()
