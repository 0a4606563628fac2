"""Fill a model's parameters from the safetensors files of a Hugging Face checkpoint:
one model.safetensors, or the shards that model.safetensors.index.json lists."""

import pathlib
import re

from safetensors import safe_open
from torch import nn

from ..model_config import read_json

# checkpoint name fragment -> (fused parameter fragment, shard id)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# one expert's weight, `...mlp.experts.<e>.<gate|up|down>_proj.weight`: it fills a slice of a stacked parameter
EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def checkpoint_target(name: str) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills, and which shard of it (None: all of it)."""
    if match := EXPERT_WEIGHT.search(name):
        stacked = "down_proj" if match[2] == "down" else "gate_up_proj"
        return f"{name[: match.start()]}.experts.{stacked}", (int(match[1]), match[2])
    for fragment, (fused, shard) in PACKED_MODULES.items():
        if f".{fragment}." in name:
            return name.replace(fragment, fused), shard
    return name, None


def weight_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    path = pathlib.Path(model_dir)
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return sorted(path.glob("*.safetensors"))
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
        raise ValueError(f"{index}: weight_map must map weight names to shard file names")
    files = sorted({path / name for name in weight_map.values()})
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{index} lists shards that are missing: {', '.join(missing)}")
    return files


def load_weights(model: nn.Module, model_dir: str | pathlib.Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.lm_head, "weight", None) is model.model.embed_tokens.weight
    # every parameter must be filled completely: fused ones by each of their shards
    # (stacked expert weights list their pieces in `shard_ids`)
    needed = {name: set(getattr(param, "shard_ids", ())) or {shard for frag, (fused, shard) in PACKED_MODULES.items() if f".{fused}." in name}
              or {None} for name, param in params.items()}
    if tied:
        del needed["lm_head.weight"]
    for file in weight_files(model_dir):
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                if tied and name == "lm_head.weight":
                    continue  # the head shares the embedding's weight
                target, shard_id = checkpoint_target(name)
                if target not in params:
                    if "rotary_emb.inv_freq" in name:
                        continue  # a buffer some old checkpoints store; we compute it
                    raise ValueError(f"the checkpoint has a weight {name!r} that this model does not expect")
                param = params[target]
                loader = getattr(param, "weight_loader", None)
                tensor = f.get_tensor(name)
                if loader is not None:
                    loader(param, tensor, shard_id)
                else:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
                    param.data.copy_(tensor)
                needed.get(target, set()).discard(shard_id)
    missing = [name if shards == {None} else f"{name} {sorted(shards)[:4]}" for name, shards in sorted(needed.items()) if shards]
    if missing:
        raise ValueError(f"the checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}")
