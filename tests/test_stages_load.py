"""stages.load takes every stage name the tools take, and `import stages` works from any
directory once the project is installed (the README's Python snippet included)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stages
from stages.__main__ import main as stages_main
from tools import stages as stage_tool

ROOT = Path(__file__).resolve().parents[1]

FORMS = [
    "03_paged",
    "03",
    "3",
    3,
    "paged",
    "stages/03_paged",
    "stages/03_paged/",
    "./stages/03_paged",
    str(ROOT / "stages" / "03_paged"),
    Path("stages/03_paged"),
    "stages.03_paged",
    " 03 ",
]


@pytest.mark.parametrize("form", FORMS, ids=repr)
def test_every_form_loads_the_stage(form):
    assert stages.load(form).__name__ == "stages.03_paged"
    assert stage_tool.resolve(ROOT, str(form)).name == "03_paged"  # the stage tool: the same names


@pytest.mark.parametrize("form", ["final", "nanovllm_final", "nanovllm_final/"])
def test_final_by_name(form):
    assert stages.load(form).__name__ == "nanovllm_final"
    assert stage_tool.resolve(ROOT, form).name == "final"


def test_every_stage_by_number_and_name():
    for name in stages.names():
        assert (
            stages.load(int(name[:2]))
            is stages.load(name[:2])
            is stages.load(name[3:])
            is stages.load(name)
        )


@pytest.mark.parametrize(
    "bad", ["09", "9", "", "pag", "stages", "03_paged_x", True, 3.0, None], ids=repr
)
def test_unknown_names_list_the_stages(bad):
    with pytest.raises(
        ValueError, match="valid stages: 01_naive, 02_kvcache, .*final|a stage is named by"
    ):
        stages.load(bad)


def test_resolve_is_ambiguity_safe():
    with pytest.raises(ValueError, match="unknown stage"):
        stages.resolve("3", ["03_a", "03_b"])


def test_python_m_stages_runs_any_stage_by_any_name(model_dir, capsys):
    path = str(model_dir("qwen3"))
    capsys.readouterr()  # whatever building the model printed
    stages_main(
        ["paged", "--model", path, "--prompt", "hello", "--max-tokens", "3", "--device", "cpu"]
    )
    assert capsys.readouterr().out.startswith("### hello\n")
    with pytest.raises(SystemExit) as exit_info:
        stages_main(["9", "--model", "x", "--prompt", "y"])
    assert exit_info.value.code == 2 and "unknown stage '9'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        stages_main(["--help"])
    assert exit_info.value.code == 0 and "07_tensor_parallel, final" in capsys.readouterr().out


def readme_snippet() -> str:
    """The README's Python example of stages.load."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if "import stages" in b and "stages.load(" in b]
    assert len(found) == 1, "the README should have one Python snippet that loads a stage"
    return found[0]


def test_installed_stages_import_from_any_directory(tmp_path):
    """Build the project as pip installs it (from a copy, so the checkout stays clean), then
    import stages and run the README's snippet from an unrelated directory."""
    src, target, elsewhere = tmp_path / "src", tmp_path / "site", tmp_path / "elsewhere"
    for folder in ("stages", "nanovllm_final"):
        shutil.copytree(
            ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    for file in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file, src / file)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(target),
        str(src),
    ]
    build = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    elsewhere.mkdir()
    snippet = readme_snippet()
    assert (
        '"models/course-llama"' in snippet
    )  # a path relative to the repository: from elsewhere, the full one
    code = (
        "import stages\n"
        f"assert stages.__file__.startswith({str(target)!r}), stages.__file__\n"
        "assert stages.load('3').__name__ == 'stages.03_paged' and stages.load('final').__name__ == 'nanovllm_final'\n"
        "print('stages:', ', '.join(stages.names()))\n"
        + snippet.replace('"models/course-llama"', repr(str(ROOT / "models" / "course-llama")))
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "stages: " + ", ".join(stages.names())
    assert re.fullmatch(
        r".* \[\d+(, \d+)*\]", lines[-1]
    )  # the completion's text, then its token ids
