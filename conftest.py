"""pytest settings shared by `pytest tests` and `pytest --nbval notebooks` (fixtures: tests/conftest.py).

`make test` runs both in one pytest session on one pytest-xdist worker per core
(`-n auto`; `--dist loadgroup` comes from pyproject.toml). This file keeps that fast and safe:
- one torch thread per process;
- each notebook is an xdist group (its cells share one kernel, so they run in order on one
  worker), and so are the tests marked `xdist_group("processes")` (they start processes);
- the notebooks' shared model is built before any notebook runs.
"""

import os

import pytest

# One torch thread per process, set before anything imports torch and inherited by every
# process a test starts (TP workers, subprocesses, notebook kernels). On a busy 2-core
# machine, intra-op threads that wait for each other make these tiny models 10-30x slower,
# and the xdist workers already use the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    # On a fresh checkout two notebooks would otherwise build .models/tiny-qwen3 at once
    # (on two workers). Built here, in the main process, before any worker starts.
    if config.getoption("nbval", False) and not os.environ.get("PYTEST_XDIST_WORKER"):
        from tools.tiny_model import cached_model

        cached_model("tiny-qwen3", arch="qwen3")  # the very call of the notebooks' first cells


@pytest.hookimpl(trylast=True)  # after xdist's own implementation
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.xdist_group(f"notebook-{item.path.stem}"))
    if config.getoption("loadgroup", False):  # set by xdist on its workers
        add_group_suffixes(items)


def add_group_suffixes(items):
    """What --dist loadgroup does on a worker: append `@<group>` to the node id of each test
    marked xdist_group, for the scheduler to read. pytest-xdist 3.8 writes it into the legacy
    `_nodeid` field, which pytest >= 9.2 no longer reads, so without this the groups are
    silently ignored (pytest-dev/pytest-xdist#1386); where xdist did add it, nothing changes."""
    for item in items:
        names = sorted(
            {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
        )
        nodeid = item.nodeid
        if names and not nodeid.rfind("@") > nodeid.rfind("]"):
            item._id = type(item._id).parse(f"{nodeid}@{'_'.join(names)}")
