"""Shared fixtures: the tiny models and Hugging Face references, built once per test session.

`make test` runs the suite on pytest-xdist workers (see ../conftest.py). To stay fast, a new test:
- takes its models from `model_dir(name)` (name: a key of common.TINY_MODELS; add a key
  rather than calling make_model) and its references from `hf_greedy(...)`: both are
  computed once per session and shared by all workers through files;
- leaves torch at one thread (OMP_NUM_THREADS=1, set in ../conftest.py);
- shares an LLM between tests with a module-scoped fixture where the tests only read it;
- if it starts processes (process groups, spawned workers, servers), carries
  `@pytest.mark.xdist_group("processes")` (a module: `pytestmark = ...`), as
  test_tensor_parallel.py does: such tests then run one after another on one worker
  while the others run the rest.
"""

import os

import torch

# Triton kernels run in the interpreter on CPU; this must be set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402
from common import TINY_MODELS  # noqa: E402
from filelock import FileLock  # noqa: E402

from tools.tiny_model import build_if_missing  # noqa: E402


def shared_dir(tmp_path_factory, name: str) -> pathlib.Path:
    """A folder of this test session that every xdist worker sees (the workers' temporary
    directories are siblings); without xdist, one under the session's temporary directory."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(name) -> path of a tiny checkpoint (a key of common.TINY_MODELS), built
    once per session, whichever xdist worker asks first."""
    root = shared_dir(tmp_path_factory, "models")

    @functools.cache
    def build(name: str) -> pathlib.Path:
        with FileLock(root / f"{name}.lock"):
            return build_if_missing(root / name, shape="tiny", **TINY_MODELS[name])

    return build


@functools.cache
def fingerprint(path: pathlib.Path) -> str:
    """A hash of everything in a model directory (weights, configs, tokenizer)."""
    h = hashlib.sha256()
    for file in sorted(p for p in pathlib.Path(path).rglob("*") if p.is_file()):
        h.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return h.hexdigest()


@pytest.fixture(scope="session")
def hf_greedy(tmp_path_factory):
    """hf_greedy(model_dir, prompt_ids, max_new_tokens) -> Hugging Face's greedy completion
    (stopping at the checkpoint's EOS ids, which transformers reads from generation_config.json).

    Each (model contents, prompt, max_new_tokens) is computed once per session: the result
    is kept in a file that the other xdist workers read instead of running the model again."""
    import transformers
    from transformers import AutoModelForCausalLM

    cache = shared_dir(tmp_path_factory, "hf_greedy")
    models = {}

    def generate(path: pathlib.Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = models[path].generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        return out[0, len(prompt) :].tolist()

    @functools.cache
    def run(path: pathlib.Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        path = pathlib.Path(path)
        key = json.dumps(
            [fingerprint(path), transformers.__version__, list(prompt), max_new_tokens]
        )
        file = cache / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
        with FileLock(f"{file}.lock"):  # a worker asking for the same reference waits for it
            if not file.exists():
                tmp = file.with_suffix(".tmp")
                tmp.write_text(json.dumps(generate(path, tuple(prompt), max_new_tokens)))
                tmp.rename(file)
            return json.loads(file.read_text())

    return run


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def transformers_log():
    """What transformers logs (its logger does not propagate to the root, so caplog cannot see it)."""
    handler, logger = Records(), logging.getLogger("transformers")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)
