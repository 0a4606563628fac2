"""The stage ladder: one self-contained engine per folder, each adding one mechanism.

Stage folders start with a digit, so they cannot appear in an ``import`` statement.
Load them by name instead::

    import stages
    naive = stages.load("01_naive")          # or "01", "1", 1, "naive", "stages/01_naive", "stages.01_naive"
    llm = naive.LLM(model_dir)
    final = stages.load("final")             # the finished engine, nanovllm_final

Run one from the command line the same way: ``python -m stages 03 --model DIR --prompt "Hello"``.
"""

import importlib
import importlib.util
import pathlib
from types import ModuleType

_HERE = pathlib.Path(__file__).parent
FINAL = "final"  # the name of the finished engine on the ladder (the package nanovllm_final)
FINAL_PACKAGE = "nanovllm_final"


def names() -> list[str]:
    """All stage folder names in ladder order, e.g. ['01_naive', '02_kvcache', ...]."""
    return sorted(
        p.name
        for p in _HERE.iterdir()
        if p.is_dir() and p.name[:2].isdigit() and (p / "__init__.py").exists()
    )


def resolve(name: str | int | pathlib.Path, choices: list[str]) -> str:
    """The one entry of `choices` (stage folder names such as "03_paged", and "final") that
    `name` means. Every tool that takes a stage name uses this, so they all accept the same
    forms: "03_paged", "03", "3", 3, "paged", "stages/03_paged", "stages.03_paged", a path
    ending in the folder, and "final" or "nanovllm_final". Raises ValueError otherwise."""
    if isinstance(name, bool) or not isinstance(name, (str, int, pathlib.PurePath)):
        raise ValueError(f"a stage is named by a string or a number, got {name!r}")
    key = (
        str(name).strip().replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    )  # a path: its last folder
    key = key.removeprefix("stages.")
    key = FINAL if key == FINAL_PACKAGE else key

    def matches(choice: str) -> bool:
        if choice == FINAL:
            return key == FINAL
        if key.isdigit():
            return int(key) == int(choice[:2])
        return key in (choice, choice[3:])

    found = [choice for choice in choices if matches(choice)]
    if len(found) != 1:
        raise ValueError(f"unknown stage {name!r}; valid stages: {', '.join(choices)}")
    return found[0]


def load(name: str | int | pathlib.Path) -> ModuleType:
    """Import a stage package by any name `resolve` accepts ("03_paged", "03", 3, "paged", ...)."""
    choices = names() + ([FINAL] if importlib.util.find_spec(FINAL_PACKAGE) else [])
    found = resolve(name, choices)
    return importlib.import_module(FINAL_PACKAGE if found == FINAL else f"{__name__}.{found}")
