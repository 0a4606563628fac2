"""Where the checks get the stage's own code, and the model they run it on."""

import importlib
from types import ModuleType

import stages


def module(stage: str, name: str) -> ModuleType:
    """A stage's own module, e.g. module("03_paged", "engine.block_manager")."""
    return importlib.import_module(f"{stages.load(stage).__name__}.{name}")


def tiny_model() -> str:
    """The tiny random-weight Qwen3 of the notebooks (built once into .models/)."""
    from tools.tiny_model import cached_model

    return str(cached_model("tiny-qwen3", arch="qwen3"))


load = stages.load  # the stage package itself: load("03_paged").LLM, .SamplingParams
