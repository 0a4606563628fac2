"""The code the notebooks show is the code: every listing drawn by notebooks/codeview.py (diff
tables, diffs, sources) must equal what its recorded call renders from the source now
(`python -m tools.listings check`; `write` regenerates them), and a stale one is caught."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels.ipynb shows Triton kernels' source

from pathlib import Path  # noqa: E402

import nbformat  # noqa: E402
import pytest  # noqa: E402

from tools import listings  # noqa: E402

NOTEBOOKS = sorted(listings.NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_listing_is_current(path: Path):
    problems = listings.stale(path)
    assert not problems, (
        "stale listings (python -m tools.listings write rewrites them):\n" + "\n\n".join(problems)
    )


def test_the_listings_are_there():
    marked = {p.stem: len(listings.listings(nbformat.read(p, as_version=4))) for p in NOTEBOOKS}
    assert all(marked[n] > 0 for n in marked if n[:2].isdigit() or n == "kernels"), marked


def _plant(tmp_path: Path, edit) -> Path:
    path = listings.NOTEBOOKS / "04_prefix_cache.ipynb"
    nb = nbformat.read(path, as_version=4)
    edit(nb)
    out = tmp_path / path.name
    nbformat.write(nb, out)
    return out


def test_a_stale_listing_is_caught_and_rewritten(tmp_path: Path):
    def old_free_list(nb):  # the listing as it was before the free list became an OrderedDict
        first = listings.listings(nb)[1]
        data = nb.cells[first.cell].outputs[first.output].data
        data["text/markdown"] = data["text/markdown"].replace("popitem(last=False)[0]", "popleft()")

    path = _plant(tmp_path, old_free_list)
    problems = listings.stale(path)
    assert (
        len(problems) == 1 and "popleft()" in problems[0] and "block_manager.py" in problems[0]
    ), problems
    assert listings.write(path) == 1 and listings.stale(path) == []


def test_a_stale_diff_table_is_caught(tmp_path: Path):
    def old_counts(nb):
        first = listings.listings(nb)[0]
        data = nb.cells[first.cell].outputs[first.output].data
        data["text/markdown"] = data["text/markdown"].replace("| +1 −0 |", "| +2 −0 |")

    problems = listings.stale(_plant(tmp_path, old_counts))
    assert len(problems) == 1 and "diff_table('03_paged', '04_prefix_cache')" in problems[0], (
        problems
    )


def test_a_listing_without_its_mark_is_caught(tmp_path: Path):
    def unmarked(nb):
        first = listings.listings(nb)[0]
        data = nb.cells[first.cell].outputs[first.output].data
        data["text/markdown"] = listings.MARK.sub("", data["text/markdown"])

    problems = listings.stale(_plant(tmp_path, unmarked))
    assert len(problems) == 1 and "no `<!-- codeview" in problems[0], problems


def test_file_names_are_shown_literally():
    codeview = listings.importlib.import_module("notebooks.codeview")
    table = codeview.diff_table("03_paged", "04_prefix_cache").data
    assert "[`__init__.py`](../stages/04_prefix_cache/__init__.py)" in table, table
