"""The code the notebooks show, kept equal to the code: every listing that notebooks/codeview.py
draws (a diff table, a diff, a function's source) ends with a hidden `<!-- codeview: CALL -->`,
the call that made it. This tool renders each such call again from the source as it is now.

    python -m tools.listings check [NOTEBOOK ...]   # exit 1, naming cell and call, if a listing is stale
    python -m tools.listings write [NOTEBOOK ...]   # rewrite the stale listings in place (nothing re-run)

Listing cells carry NBVAL_IGNORE_OUTPUT (a fix carried forward must not break nbval), and the book
renders the committed outputs, so this check is what stops a notebook from showing old code.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MARK = re.compile(r"<!-- codeview: ([^\n]+) -->\s*\Z")  # the last line of a listing
CALLS = ("diff_table", "diff", "source")


@dataclass
class Listing:
    cell: int  # index of the code cell in the notebook
    output: int  # index of the output in that cell
    call: str  # e.g. "diff_table('03_paged', '04_prefix_cache')"
    committed: str  # the Markdown the notebook holds


def listings(nb) -> list[Listing]:
    found = []
    for i, cell in enumerate(nb.cells):
        for j, out in enumerate(cell.get("outputs", [])):
            text = out.get("data", {}).get("text/markdown")
            if text and (m := MARK.search(text)):
                found.append(Listing(i, j, m.group(1), text))
    return found


def unmarked(nb) -> list[int]:
    """Code cells that call codeview but hold fewer marked listings than calls (outputs from an
    older codeview, or none): those can go stale unseen."""
    bad = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        calls = len(re.findall(rf"codeview\.(?:{'|'.join(CALLS)})\(", cell.source))
        marked = sum(
            1
            for out in cell.get("outputs", [])
            if MARK.search(out.get("data", {}).get("text/markdown", ""))
        )
        if calls > marked:
            bad.append(i)
    return bad


def render(call: str) -> str:
    """The Markdown that a marked call renders from the code as it is now."""
    codeview = importlib.import_module("notebooks.codeview")
    name = call.split("(", 1)[0]
    if name not in CALLS:
        raise ValueError(f"not a codeview listing call: {call!r}")
    return eval(call, {"__builtins__": {}}, {n: getattr(codeview, n) for n in CALLS}).data  # noqa: S307


def stale(path: Path) -> list[str]:
    """What is wrong with a notebook's listings, one message each (empty: all current)."""
    nb = nbformat.read(path, as_version=4)
    problems = [
        f"{path.name} cell {i}: calls codeview but its output has no `<!-- codeview: ... -->` mark; "
        "run the cell again"
        for i in unmarked(nb)
    ]
    for listing in listings(nb):
        now = render(listing.call)
        if now != listing.committed:
            delta = difflib.unified_diff(
                listing.committed.splitlines(),
                now.splitlines(),
                "committed",
                "code now",
                n=1,
                lineterm="",
            )
            shown = "\n".join(list(delta)[2:14])
            problems.append(
                f"{path.name} cell {listing.cell}: {listing.call} differs from the code:\n{shown}"
            )
    return problems


def write(path: Path) -> int:
    """Rewrite a notebook's stale listings; returns how many changed."""
    nb = nbformat.read(path, as_version=4)
    changed = 0
    for listing in listings(nb):
        now = render(listing.call)
        if now != listing.committed:
            nb.cells[listing.cell].outputs[listing.output].data["text/markdown"] = now
            changed += 1
    if changed:
        nbformat.write(nb, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.listings", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("action", choices=["check", "write"])
    parser.add_argument(
        "notebooks", nargs="*", type=Path, help="default: every notebook in notebooks/"
    )
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.action == "write":
        for path in paths:
            print(f"{path.name}: {write(path)} listings rewritten")
        return 0
    problems = [p for path in paths for p in stale(path)]
    print(
        "\n\n".join(problems) if problems else f"every listing in {len(paths)} notebooks is current"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
