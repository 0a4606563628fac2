"""Command-line flags generated from the option fields (validate.py's `option`): the engine
options (EngineConfig) for every command of the `nanovllm` console script (generate, chat,
bench and serve), and the sampling options (SamplingParams). A flag left out is None: the
option keeps its default. `model` is each command's own; the engine's `seed` is
`--engine-seed` (`--seed` is a request's)."""

import argparse

from .config import EngineConfig
from .sampling_params import SamplingParams
from .validate import options

MODEL_HELP = "checkpoint directory, or a hub id in the local Hugging Face cache"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, cls: type, title: str, prefix: str = "") -> None:
    """One flag per option of `cls`, its value stored as `prefix + name`. A bool gets --x (and
    --no-x when it is on by default); a list is given by repeating the flag."""
    group = parser.add_argument_group(title)
    for o in options(cls):
        name, dest, spec = (
            ("engine_seed" if prefix and o.name == "seed" else o.name),
            prefix + o.name,
            o.spec,
        )
        if spec.kind is bool:
            action = argparse.BooleanOptionalAction if o.default else "store_true"
            group.add_argument(flag(name), dest=dest, action=action, default=None, help=o.help)
        elif spec.kind is list:
            group.add_argument(
                flag(name),
                dest=dest,
                action="append",
                type=spec.items,
                metavar=spec.items.__name__.upper(),
                help=o.help,
            )
        else:
            kind = spec.kind or str
            default = (
                "" if o.default is None else f" (default: {o.default})"
            )  # None: the help says what happens
            group.add_argument(
                flag(name),
                dest=dest,
                type=kind,
                metavar=kind.__name__.upper(),
                help=o.help + default,
            )


def given(args: argparse.Namespace, cls: type, prefix: str = "") -> dict:
    """The options of `cls` given on the command line, as keyword arguments."""
    values = {o.name: getattr(args, prefix + o.name) for o in options(cls)}
    return {name: value for name, value in values.items() if value is not None}


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    add_options(
        parser,
        EngineConfig,
        "engine options (LLM(model, **options); see nanovllm_final's README)",
        "engine_",
    )


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as LLM's keyword arguments."""
    return given(args, EngineConfig, "engine_")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    add_options(
        parser,
        SamplingParams,
        "sampling (SamplingParams; unset: the checkpoint's generation_config.json, else vLLM's defaults)",
    )


def sampling_params(args: argparse.Namespace, **overrides) -> SamplingParams:
    """The SamplingParams of the sampling flags given, with `overrides` on top."""
    return SamplingParams(**(given(args, SamplingParams) | overrides))
