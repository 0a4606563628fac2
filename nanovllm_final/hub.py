"""Where a model lives: a local directory, or a Hugging Face hub id found in the local cache."""

import os
import pathlib

from .validate import Problem


def hub_cache_dir() -> pathlib.Path:
    """The hub cache huggingface_hub uses, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return pathlib.Path(home).expanduser() / "hub"


def looks_like_repo_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~")) and "\\" not in model


def resolve_model(model: str | os.PathLike) -> pathlib.Path:
    """The checkpoint directory for `model`: the directory itself, or the cached snapshot of a
    hub id such as "Qwen/Qwen3-0.6B" (never downloads: works offline)."""
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise Problem(f"model must be a checkpoint directory or a hub id, got {model!r}", "model")
    path = pathlib.Path(model).expanduser()
    if path.is_dir() or not looks_like_repo_id(str(model)):
        return path  # a local directory (ModelConfig.from_dir says what is wrong with it)
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return pathlib.Path(snapshot_download(str(model), cache_dir=cache, local_files_only=True))
    except Exception as err:  # LocalEntryNotFoundError, or a cache without this repo
        raise FileNotFoundError(
            f"{model!r} is not a local directory, and the Hugging Face cache ({cache}) has no snapshot of it; "
            f"download it first with `huggingface-cli download {model}` (or `hf download {model}`), "
            "or pass the path of a checkpoint directory"
        ) from err
