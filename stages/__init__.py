"""The stage ladder: one self-contained engine per folder, each adding one mechanism.

Stage folders start with a digit, so they cannot appear in an ``import`` statement.
Load them by name instead::

    import stages
    naive = stages.load("01_naive")          # or stages.load(1)
    llm = naive.LLM(model_dir)
"""

import importlib
import pathlib
from types import ModuleType

_HERE = pathlib.Path(__file__).parent


def names() -> list[str]:
    """All stage folder names in ladder order, e.g. ['01_naive', '02_kvcache', ...]."""
    return sorted(p.name for p in _HERE.iterdir() if p.is_dir() and p.name[:2].isdigit() and (p / "__init__.py").exists())


def load(name: str | int) -> ModuleType:
    """Import a stage package by folder name ("03_paged") or number (3)."""
    if isinstance(name, int):
        matches = [n for n in names() if int(n[:2]) == name]
    else:
        matches = [n for n in names() if n == name or n.split("_", 1)[-1] == name]
    if len(matches) != 1:
        raise ValueError(f"unknown stage {name!r}; stages are: {', '.join(names())}")
    return importlib.import_module(f"stages.{matches[0]}")
