"""tools/stages.py on small fixture ladders (and `check` on the real repo once it has stages)."""

import subprocess
from pathlib import Path

import pytest

from tools.stages import drop_markers, main

REPO = Path(__file__).parents[1]

ENGINE = "".join(
    f"line {i}\n" for i in range(1, 13)
)  # long enough for non-adjacent edits to merge cleanly


def readme(*listed: str) -> str:
    return (
        "# Stage\n\nWhat it adds.\n\n## Files changed\n\n"
        + "".join(f"- `{p}` — why\n" for p in listed)
        + "\n## Next\n\n- `not/a/listing.py`\n"
    )


def edit(text: str, lineno: int, new: str) -> str:
    lines = text.splitlines(keepends=True)
    lines[lineno - 1] = new + "\n"
    return "".join(lines)


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """01 -> 02 (edits engine.py line 2, adds cache.py) -> 03 (adds sched/scheduler.py) -> final (same as 03)."""
    s01 = {
        "__init__.py": '"""Naive: one request at a time.\n\nDetails."""\n',
        "engine.py": ENGINE,
        "model.py": "model\n",
    }
    s02 = s01 | {
        "__init__.py": '"""KV cache: keep keys and values."""\n',
        "engine.py": edit(ENGINE, 2, "line 2 kv"),
        "cache.py": "cache\n",
    }
    s03 = s02 | {"__init__.py": '"""Paged: blocks."""\n', "sched/scheduler.py": "a\nb\n"}
    files = {f"stages/01_naive/{p}": t for p, t in (s01 | {"README.md": "# Naive\n"}).items()}
    files |= {
        f"stages/02_kvcache/{p}": t
        for p, t in (s02 | {"README.md": readme("engine.py", "cache.py", "__init__.py")}).items()
    }
    files |= {
        f"stages/03_paged/{p}": t
        for p, t in (s03 | {"README.md": readme("./sched/scheduler.py", "__init__.py")}).items()
    }
    files |= {f"nanovllm_final/{p}": t for p, t in (s03 | {"README.md": readme()}).items()}
    files |= {
        "stages/__init__.py": "",
        "stages/03_paged/__pycache__/x.cpython-311.pyc": "junk",
        "stages/02_kvcache/y.pyc": "junk",
    }
    write(tmp_path, files)
    return tmp_path


def git(root: Path, *args: str) -> None:
    cfg = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "-C", str(root), *cfg, *args], check=True, capture_output=True)


@pytest.fixture
def repo(tree: Path) -> Path:
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "ladder")
    return tree


def run(root: Path, *argv: str) -> int:
    return main([*argv, "--root", str(root)])


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and ".git" not in p.parts
    }


# ---------------------------------------------------------------------------------------------- diff


def test_diff_table_and_unified_diff(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tree, "diff", "01", "02_kvcache") == 0
    out = capsys.readouterr().out
    table = out.split("\n--- ", 1)[0].splitlines()
    assert table[0].split() == ["path", "status", "+lines", "-lines"]
    rows = {fields[0]: fields[1:] for fields in map(str.split, table[1:-1])}
    assert rows.keys() == {
        "README.md",
        "__init__.py",
        "cache.py",
        "engine.py",
    }  # no model.py (same), no *.pyc
    assert rows["engine.py"] == ["modified", "+1", "-1"]
    assert rows["cache.py"] == ["added", "+1", "-0"]
    assert rows["__init__.py"] == ["modified", "+1", "-3"]
    assert table[-1] == "stages/01_naive -> stages/02_kvcache: 4 file(s) changed, +16 -5"
    assert "--- a/stages/01_naive/engine.py\n+++ b/stages/02_kvcache/engine.py\n" in out
    assert "-line 2\n+line 2 kv\n" in out
    assert "--- /dev/null\n+++ b/stages/02_kvcache/cache.py\n" in out


def test_diff_stat_removed_and_final(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tree, "diff", "final", "2", "--stat") == 0
    out = capsys.readouterr().out
    assert "sched/scheduler.py  removed" in out
    assert "@@" not in out and "---" not in out
    assert "nanovllm_final -> stages/02_kvcache:" in out


def test_diff_identical(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tree, "diff", "paged", "03") == 0
    assert "are identical" in capsys.readouterr().out


def test_unknown_stage_lists_valid_ones(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tree, "diff", "01", "09") == 2
    assert (
        "unknown stage '09'; valid stages: 01_naive, 02_kvcache, 03_paged, final"
        in capsys.readouterr().err
    )


# --------------------------------------------------------------------------------------------- check


def test_check_passes(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tree, "check") == 0
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()] == [
        ["skip", "01_naive:"],
        ["OK", "02_kvcache:"],
        ["OK", "03_paged:"],
        ["OK", "final:"],
    ]


def test_check_fails_on_unlisted_change(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for stage in ("stages/03_paged", "nanovllm_final"):  # final follows 03, so only 03 is wrong
        write(tree, {f"{stage}/model.py": "model v2\n", f"{stage}/extra.py": "x\n"})
    assert run(tree, "check") == 1
    out = capsys.readouterr().out
    assert "FAIL 03_paged:\n" in out and "OK   final:" in out
    assert "stages/03_paged/model.py: modified vs 02_kvcache but not listed in README.md" in out
    assert "stages/03_paged/extra.py: added vs 02_kvcache but not listed in README.md" in out
    assert "check failed: 2 problem(s)" in out


def test_check_fails_on_stale_listing(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        tree,
        {"stages/02_kvcache/README.md": readme("engine.py", "cache.py", "__init__.py", "model.py")},
    )
    assert run(tree, "check") == 1
    assert (
        "stages/02_kvcache/model.py: listed in README.md but identical to 01_naive (stale listing)"
        in capsys.readouterr().out
    )


def test_one_listing_line_may_name_several_files(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        tree,
        {
            "stages/03_paged/model.py": "model v3\n",
            "stages/03_paged/README.md": readme("./sched/scheduler.py", "__init__.py").replace(
                "- `__init__.py` — why",
                "- `__init__.py`, `model.py` — why, with `not/a/path.py` in the prose",
            ),
        },
    )
    assert (
        run(tree, "check") == 1
    )  # model.py is listed now, but final (a copy of the old 03) differs from 03 in it
    out = capsys.readouterr().out
    assert (
        "OK   03_paged:" in out
        and "nanovllm_final/model.py: modified vs 03_paged but not listed" in out
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "# KV cache\n\n- `engine.py`\n",
            "stages/02_kvcache/README.md has no '## Files changed' section",
        ),
        (None, "stages/02_kvcache/README.md is missing"),
    ],
)
def test_check_fails_on_missing_section(
    tree: Path, capsys: pytest.CaptureFixture[str], text: str | None, problem: str
) -> None:
    path = tree / "stages/02_kvcache/README.md"
    if text is None:
        path.unlink()
    else:
        path.write_text(text)
    assert run(tree, "check") == 1
    assert problem in capsys.readouterr().out


def test_check_skips_final_without_section(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        tree, {"nanovllm_final/README.md": "# nano-vllm\n", "nanovllm_final/model.py": "diverged\n"}
    )
    assert run(tree, "check") == 0
    assert (
        "skip final: nanovllm_final/README.md has no '## Files changed' section"
        in capsys.readouterr().out
    )


# ------------------------------------------------------------------------------------------- markers


@pytest.mark.parametrize(
    ("text", "keep", "expected"),
    [
        ("x = 1  # NEW in 04_prefix_cache\n", None, "x = 1\n"),
        ("x = 1  # NEW in 04_prefix_cache: now shareable\n", None, "x = 1  # now shareable\n"),
        ("    # NEW in 03_paged: the block pool\n    y\n", None, "    # the block pool\n    y\n"),
        ('    """NEW in 03_paged: a pool of blocks.\n', None, '    """A pool of blocks.\n'),
        ("    NEW in 03_paged: the cache is a pool.\n", None, "    The cache is a pool.\n"),
        ("    NEW in 03_paged: `tp_dim` says\n", None, "    `tp_dim` says\n"),
        ("    # NEW in 04_prefix_cache\n    z\r\n", None, "    z\r\n"),
        (
            "a  # NEW in 04_prefix_cache: b\nc  # NEW in 05_chunked_prefill: d\n",
            "05_chunked_prefill",
            "a  # b\nc  # NEW in 05_chunked_prefill: d\n",
        ),
    ],
)
def test_drop_markers(text: str, keep: str | None, expected: str) -> None:
    assert drop_markers(text, keep) == expected


def marked(tree: Path) -> Path:
    """02 marks its line 2; 03 inherits the line with the marker dropped: the rule holds."""
    write(
        tree,
        {"stages/02_kvcache/engine.py": edit(ENGINE, 2, "line 2 kv  # NEW in 02_kvcache: cached")},
    )
    for rung in ("stages/03_paged", "nanovllm_final"):
        write(tree, {f"{rung}/engine.py": edit(ENGINE, 2, "line 2 kv  # cached")})
    return tree


def test_check_passes_with_markers_that_follow_the_rule(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        run(marked(tree), "check") == 0
    )  # 03's engine.py differs from 02 only by the dropped marker: not listed
    assert "OK   03_paged:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("rung", "line", "problem"),
    [
        (
            "stages/03_paged",
            "line 2 kv  # NEW in 02_kvcache: cached",  # stale: the stage after 02 kept 02's marker
            "stages/03_paged/engine.py:2: marker 'NEW in 02_kvcache' (03_paged marks only what it adds; drop it)",
        ),
        (
            "stages/03_paged",
            "line 2 kv  # NEW in 04_prefix_cache: cached",  # names a later stage
            "stages/03_paged/engine.py:2: marker 'NEW in 04_prefix_cache' (03_paged marks only what it adds; drop it)",
        ),
        (
            "nanovllm_final",
            "line 2 kv  # NEW in 03_paged: cached",
            "nanovllm_final/engine.py:2: marker 'NEW in 03_paged' (the final engine carries no stage markers; drop it)",
        ),
    ],
)
def test_check_fails_on_a_stale_marker(
    tree: Path, capsys: pytest.CaptureFixture[str], rung: str, line: str, problem: str
) -> None:
    marked(tree)
    write(tree, {f"{rung}/engine.py": edit(ENGINE, 2, line)})
    assert run(tree, "check") == 1
    assert problem in capsys.readouterr().out


def test_check_fails_on_a_marker_in_the_first_stage_and_unpaired_final(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        tree,
        {
            "stages/01_naive/model.py": "model  # NEW in 02_kvcache\n",
            "nanovllm_final/README.md": "# nano-vllm\n",
            "nanovllm_final/model.py": "m  # NEW in 03_paged: x\n",
        },
    )
    assert run(tree, "check") == 1
    out = capsys.readouterr().out
    assert "FAIL 01_naive:\n  stages/01_naive/model.py:1: marker 'NEW in 02_kvcache'" in out
    assert "FAIL final:\n  nanovllm_final/model.py:1: marker 'NEW in 03_paged'" in out


def test_diff_reads_the_earlier_stage_without_its_markers(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marked(tree)
    assert run(tree, "diff", "02", "03", "--stat") == 0
    assert "engine.py" not in capsys.readouterr().out  # only the marker differs: not the lesson
    assert run(tree, "diff", "02", "03", "--raw") == 0
    assert (
        "-line 2 kv  # NEW in 02_kvcache: cached\n+line 2 kv  # cached\n" in capsys.readouterr().out
    )


# ---------------------------------------------------------------------------------------------- sync


def test_sync_copies_into_unchanged_later_stages(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(repo, {"stages/01_naive/model.py": "model fixed\n"})
    assert run(repo, "sync", "01") == 0
    out = capsys.readouterr().out
    for target in ("stages/02_kvcache", "stages/03_paged", "nanovllm_final"):
        assert (repo / target / "model.py").read_text() == "model fixed\n"
        assert f"copied     {target}/model.py" in out


def test_sync_merges_edit_into_stage_that_changed_other_lines(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(repo, {"stages/01_naive/engine.py": edit(ENGINE, 10, "line 10 fixed")})
    assert run(repo, "sync", "naive") == 0
    assert "merged     stages/02_kvcache/engine.py" in capsys.readouterr().out
    expected = edit(edit(ENGINE, 2, "line 2 kv"), 10, "line 10 fixed")
    for target in ("stages/02_kvcache", "stages/03_paged", "nanovllm_final"):
        assert (repo / target / "engine.py").read_text() == expected


def test_sync_reports_conflict_and_writes_nothing_there(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        repo,
        {
            "stages/01_naive/engine.py": edit(ENGINE, 2, "line 2 other"),
            "stages/01_naive/model.py": "m2\n",
        },
    )
    before = snapshot(repo)
    assert run(repo, "sync", "01_naive") == 1
    out = capsys.readouterr().out
    assert "CONFLICT   stages/02_kvcache/engine.py (1 conflict(s); left untouched)" in out
    for target in ("stages/02_kvcache", "stages/03_paged", "nanovllm_final"):
        assert (repo / target / "engine.py").read_bytes() == before[f"{target}/engine.py"]
        assert (
            repo / target / "model.py"
        ).read_text() == "m2\n"  # the clean file still goes through


def test_sync_dry_run_writes_nothing(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        repo,
        {
            "stages/01_naive/model.py": "model fixed\n",
            "stages/01_naive/engine.py": edit(ENGINE, 10, "x"),
            "stages/01_naive/new.py": "new\n",
        },
    )
    before = snapshot(repo)
    assert run(repo, "sync", "1", "--dry-run") == 0
    out = capsys.readouterr().out
    assert snapshot(repo) == before
    assert "dry run: nothing is written" in out
    assert (
        "copied     stages/02_kvcache/model.py" in out
        and "merged     stages/03_paged/engine.py" in out
    )


def test_sync_propagates_new_file(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(
        repo,
        {
            "stages/02_kvcache/util/helpers.py": "def h(): ...\n",
            "nanovllm_final/util/helpers.py": "def h(): ...\n",
        },
    )
    assert run(repo, "sync", "02") == 0
    out = capsys.readouterr().out
    assert (repo / "stages/03_paged/util/helpers.py").read_text() == "def h(): ...\n"
    assert "copied     stages/03_paged/util/helpers.py" in out
    assert "up-to-date nanovllm_final/util/helpers.py" in out
    assert "01_naive" not in out


def test_sync_reports_deleted_file_without_deleting(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (repo / "stages/02_kvcache/cache.py").unlink()
    assert run(repo, "sync", "02") == 0
    assert "kept       stages/03_paged/cache.py (deleted in 02_kvcache" in capsys.readouterr().out
    assert (repo / "stages/03_paged/cache.py").exists()


def test_sync_nothing_to_do_and_bad_ref(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(repo, "sync", "02") == 0
    assert "nothing to sync: stages/02_kvcache matches HEAD" in capsys.readouterr().out
    assert run(repo, "sync", "02", "--ref", "nope") == 2
    assert "'nope' is not a commit" in capsys.readouterr().err


def test_sync_says_where_a_change_to_an_inherited_file_belongs(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        repo, {"stages/02_kvcache/model.py": "model fixed\n"}
    )  # 02 has model.py from 01, unchanged
    assert run(repo, "sync", "02") == 0
    out = capsys.readouterr().out
    assert (
        "note: stages/02_kvcache/model.py is inherited unchanged from 01_naive: make the change there "
        "and run `sync 01` (as it is, check will fail for 02_kvcache)"
    ) in out
    assert run(repo, "check") == 1  # the note is right: check fails
    assert (
        "stages/02_kvcache/model.py: modified vs 01_naive but not listed" in capsys.readouterr().out
    )
    write(repo, {"stages/01_naive/model.py": "model fixed\n"})  # following the note
    assert run(repo, "sync", "01") == 0
    assert "up-to-date stages/02_kvcache/model.py" in capsys.readouterr().out
    assert run(repo, "check") == 0


def test_sync_names_the_stage_that_last_changed_the_file(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        repo,
        {
            "stages/03_paged/engine.py": edit(
                edit(ENGINE, 2, "line 2 kv"), 11, "line 11 fixed"
            ),  # 02's version
            "stages/03_paged/model.py": "model v3\n",
        },
    )  # 01's version
    assert run(repo, "sync", "paged") == 0
    out = capsys.readouterr().out
    assert (
        "note: stages/03_paged/engine.py is inherited unchanged from 02_kvcache: make the change there and run `sync 02`"
        in out
    )
    assert (
        "note: stages/03_paged/model.py is inherited unchanged from 01_naive: make the change there and run `sync 01`"
        in out
    )


def test_sync_notes_only_what_check_will_reject(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        repo,
        {
            "stages/02_kvcache/engine.py": edit(
                edit(ENGINE, 2, "line 2 kv"), 11, "x"
            ),  # listed in 02's README
            "stages/02_kvcache/helpers.py": "new\n",
        },
    )  # new, not listed
    assert run(repo, "sync", "02") == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: stages/02_kvcache/helpers.py is not listed under '## Files changed' in "
        "stages/02_kvcache/README.md: list it there, or check will fail for 02_kvcache"
    ]


def test_sync_drops_the_source_markers_it_carries(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        repo,
        {
            "stages/02_kvcache/engine.py": edit(
                edit(ENGINE, 2, "line 2 kv"), 11, "line 11  # NEW in 02_kvcache: new"
            )
        },
    )
    assert run(repo, "sync", "02") == 0
    for rung in ("stages/03_paged", "nanovllm_final"):
        assert (repo / rung / "engine.py").read_text() == edit(
            edit(ENGINE, 2, "line 2 kv"), 11, "line 11  # new"
        )
    assert run(repo, "check") == 0


def test_sync_merges_around_markers_the_target_dropped(
    repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marked(repo)
    git(repo, "commit", "-qam", "markers")
    write(
        repo,
        {
            "stages/02_kvcache/engine.py": edit(
                edit(ENGINE, 2, "line 2 kv  # NEW in 02_kvcache: cached"), 3, "line 3 fixed"
            )
        },
    )
    assert (
        run(repo, "sync", "02") == 0
    )  # line 3 sits next to the marked line 2: merges only because markers are dropped first
    assert (repo / "stages/03_paged/engine.py").read_text() == edit(
        edit(ENGINE, 2, "line 2 kv  # cached"), 3, "line 3 fixed"
    )


def test_sync_to_stops_at_the_given_rung(repo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(repo, {"stages/01_naive/model.py": "model fixed\n"})
    assert run(repo, "sync", "01", "--to", "02") == 0
    assert (repo / "stages/02_kvcache/model.py").read_text() == "model fixed\n"
    assert (repo / "stages/03_paged/model.py").read_text() == "model\n"
    assert run(repo, "sync", "02", "--to", "01") == 2
    assert "01_naive does not come after 02_kvcache" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- list


def test_list(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(tree, "list") == 0
    assert capsys.readouterr().out.splitlines() == [
        "01_naive    Naive: one request at a time.",
        "02_kvcache  KV cache: keep keys and values.",
        "03_paged    Paged: blocks.",
        "final       Paged: blocks.",
    ]


# ------------------------------------------------------------------------------------------ real repo


def _stages_with_readme() -> int:
    stages = REPO / "stages"
    return (
        sum(
            (p / "README.md").is_file()
            for p in stages.iterdir()
            if p.is_dir() and p.name[:2].isdigit()
        )
        if stages.is_dir()
        else 0
    )


@pytest.mark.skipif(
    _stages_with_readme() < 2, reason="fewer than 2 stage folders with README.md exist yet"
)
def test_check_passes_on_real_repo() -> None:
    assert main(["check", "--root", str(REPO)]) == 0
