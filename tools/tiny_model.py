"""Offline model factory: Hugging Face model directories with random weights.

No checkpoint can be downloaded, so tests, notebooks and benchmarks use models made here:
random weights for a Qwen3, Qwen3-MoE, Qwen2 or Llama model of any shape, and a byte-level BPE tokenizer
trained in about a second on the English text below, with a ChatML chat template.

    from tools.tiny_model import make_model, cached_model
    path = make_model("/tmp/tiny-qwen3", arch="qwen3", shape="tiny", seed=0)
    path = cached_model("tiny-llama", arch="llama")  # built once, into <repo>/.models/tiny-llama

    python -m tools.tiny_model OUT_DIR --arch llama --shape tiny --seed 0 --rope-scaling llama3
    python -m tools.tiny_model .models/tiny-qwen3 --if-missing  # what cached_model("tiny-qwen3") does
    python -m tools.tiny_model .models/tiny-moe --arch qwen3_moe  # 8 experts, 2 per token
    python -m tools.tiny_model .models/qwen3-30b-a3b --shape qwen3-30b-a3b --device cuda  # ~61 GB, drawn on the GPU

Shapes: "tiny" (hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, vocab 512, float32,
init std 0.2 so that greedy output does not collapse to one token; with arch="qwen3_moe",
8 experts of width 32, 2 per token), or the shape of a real checkpoint, read from
tools/configs/ ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "llama-3.2-1b", "tinyllama-1.1b";
bfloat16, init std 0.02). Every model gets the same small tokenizer, so
the token ids in config.json and generation_config.json are that tokenizer's, also for the
real shapes; their vocab_size stays the real one (ids past the tokenizer decode to "").
"""

import argparse
import json
import math
import shutil
import tempfile
import time
from functools import cache
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MODELS_DIR = Path(__file__).resolve().parents[1] / ".models"
FULL_SHAPES = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "llama-3.2-1b", "tinyllama-1.1b")
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
QK_NORM = ("qwen3", "qwen3_moe")  # model types that normalise q and k per head
MAX_SHARD_BYTES = 4 * 1024**3  # weights above this are split into model-0000i-of-0000n files
FACTORY_VERSION = 1  # bump when make_model writes different files, so cached models are rebuilt
RECORD_FILE = "tiny_model.json"  # how make_model built a directory; written last, once complete

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2  # the BPE trainer puts special tokens first
TOKENIZER_SIZE = 500  # the tiny models' vocab_size (512) leaves a few ids past the tokenizer
CHAT_TEMPLATE = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The tokenizer's training text: varied English, some numbers, code and punctuation.
CORPUS = """\
The old lighthouse stood at the end of the harbour wall, and every evening at dusk the keeper \
climbed its ninety-two steps to light the lamp. Fishermen coming home in the dark looked for \
the beam long before they could see the town; when fog rolled in from the sea, they listened \
for the horn instead. Nobody remembers who built it, but the stones are older than the church.

Bread needs only four things: flour, water, salt and time. Mix 500 grams of flour with 350 \
grams of warm water, add 10 grams of salt and a little yeast, then leave the dough to rise \
for three or four hours. Fold it twice, shape it into a round loaf, and bake it at 230 degrees \
for forty minutes. Let it cool before you cut it, however hungry you are!

In 1843, Ada Lovelace wrote notes on Charles Babbage's Analytical Engine, a machine that was \
never finished. Her notes describe how the engine could compute Bernoulli numbers, step by \
step, and they suggest that such a machine might one day work with music or pictures as well \
as numbers. A century later, the first electronic computers filled whole rooms, used \
thousands of vacuum tubes, and were programmed by plugging cables into boards.

"Where are you going?" asked the child.
"To the market," said her grandmother. "We need apples, onions, and a new basket."
"Can I come too?"
"Only if you carry the basket on the way back."

A language model reads a sequence of tokens and predicts the next one. To generate text, it \
samples a token, appends it to the sequence, and repeats until it produces an end-of-text \
token or reaches a length limit. Serving many users at once is mostly a question of memory: \
the keys and values of every earlier token are kept in a cache, so that each new token costs \
one small step instead of a pass over the whole prompt.

def greet(name: str) -> str:
    return f"Hello, {name}!"

for i in range(10):
    print(i * i, greet("world"))

The weather report for Tuesday: cloudy in the morning, with light rain spreading from the \
west by noon. Winds of 20 to 30 km/h, stronger on the coast. Temperatures between 8 and 14 \
degrees Celsius. Wednesday should be drier and brighter, although a few showers are still \
possible in the north. The weekend looks warm and sunny; don't forget your hat.

Mountains were once thought to be permanent, but they rise and wear away like everything \
else. Rivers carry sand and stones down to the sea, frost splits rocks open, and wind \
polishes cliffs into strange shapes. What looks still to us is moving slowly, a few \
millimetres each year, over millions of years.

Q: How many legs does a spider have?
A: Eight. Insects have six, and most spiders also have eight eyes.
Q: Why is the sky blue?
A: Air scatters blue light more than red light, so blue reaches us from every direction.

Dear Sam, thank you for your letter; it arrived on Monday, the 3rd of June. The garden is \
doing well: the tomatoes are green, the beans are climbing, and the cat has claimed the \
warmest corner of the greenhouse. Please write again soon, and tell me about your new job. \
With love, Maria.
"""


def build_config(
    arch: str | None = None,
    shape: str = "tiny",
    *,
    tie_word_embeddings: bool | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    derive_head_dim: bool = False,
    rope_scaling: str | dict | None = None,
    attention_bias: bool | None = None,
    config_layout: str = "hf4",
    dtype: str | torch.dtype | None = None,
    vocab_size: int | None = None,
    num_hidden_layers: int | None = None,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_attention_heads: int | None = None,
    max_position_embeddings: int | None = None,
    init_std: float | None = None,
    num_experts: int | None = None,
    num_experts_per_tok: int | None = None,
    moe_intermediate_size: int | None = None,
    norm_topk_prob: bool | None = None,
    decoder_sparse_step: int | None = None,
    mlp_only_layers: list[int] | None = None,
) -> dict:
    """The config.json that make_model writes for this architecture, shape and overrides.

    arch: "qwen3", "qwen3_moe", "qwen2" or "llama"; None means qwen3 for "tiny" and the shape's own
    for the others. The mixture-of-experts overrides (num_experts, ...) apply to qwen3_moe only.
    Overrides left at None keep the shape's value. derive_head_dim=True leaves head_dim out,
    so readers must compute hidden_size / num_attention_heads. rope_scaling: "llama3" (Llama
    3 scaling, factor 8, original context max_position_embeddings / 16) or a dict written as
    is. attention_bias=True gives q, k, v and o projections a bias, as in transformers.
    config_layout: "hf4", what real checkpoints ship (top-level rope_theta, rope_scaling,
    torch_dtype), or "hf5", what transformers 5 writes (rope_parameters, dtype, and
    num_local_experts for num_experts).
    """
    if config_layout not in ("hf4", "hf5"):
        raise ValueError(f"config_layout must be 'hf4' or 'hf5', not {config_layout!r}")
    config = _base_config(arch, shape)
    overrides = {
        "tie_word_embeddings": tie_word_embeddings,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "attention_bias": attention_bias,
        "torch_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "vocab_size": vocab_size,
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_attention_heads,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": init_std,
    }
    moe = {
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": norm_topk_prob,
        "decoder_sparse_step": decoder_sparse_step,
        "mlp_only_layers": mlp_only_layers,
    }
    if config["model_type"] != "qwen3_moe" and any(value is not None for value in moe.values()):
        raise ValueError(
            f"the mixture-of-experts overrides apply to qwen3_moe models, not {config['model_type']}"
        )
    config |= {key: value for key, value in (overrides | moe).items() if value is not None}
    if rope_scaling is not None:
        config["rope_scaling"] = _rope_scaling(rope_scaling, config["max_position_embeddings"])
    if derive_head_dim:
        _omit_head_dim(config)
    config |= {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID}
    _check(config)
    return _hf5_layout(config) if config_layout == "hf5" else config


def _base_config(arch: str | None, shape: str) -> dict:
    if shape == "tiny":
        return _tiny_config(arch or "qwen3")
    if shape not in FULL_SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use 'tiny' or one of {FULL_SHAPES}")
    config = json.loads((CONFIG_DIR / shape / "config.json").read_text())
    if arch not in (None, config["model_type"]):
        raise ValueError(f"shape {shape!r} is a {config['model_type']} model, not {arch}")
    return config


def _tiny_config(arch: str) -> dict:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}: use one of {tuple(ARCHITECTURES)}")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.2,
        # Tied like Qwen3-0.6B; the tiny Llama is untied like TinyLlama, so both heads get tested.
        "tie_word_embeddings": arch == "qwen3",
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch in ("qwen3", "qwen3_moe", "qwen2"):
        config |= {"max_window_layers": 2, "sliding_window": None, "use_sliding_window": False}
    if arch == "qwen3_moe":  # untied like Qwen3-30B-A3B; every layer sparse unless overridden
        config |= {
            "tie_word_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    if arch == "qwen2":  # q, k, v always have a bias, o_proj never: no attention_bias field
        del config["attention_bias"]
    elif arch == "llama":
        config |= {"mlp_bias": False, "pretraining_tp": 1}
    return config


def _rope_scaling(rope_scaling: str | dict, max_position_embeddings: int) -> dict:
    if isinstance(rope_scaling, dict):
        return rope_scaling
    if rope_scaling != "llama3":
        raise ValueError(f"rope_scaling must be 'llama3' or a dict, not {rope_scaling!r}")
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": max_position_embeddings // 16,
    }


def _omit_head_dim(config: dict) -> None:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if hidden % heads or config.get("head_dim", hidden // heads) != hidden // heads:
        raise ValueError("derive_head_dim needs head_dim == hidden_size / num_attention_heads")
    if config["model_type"] in QK_NORM and hidden // heads != 128:
        # transformers' Qwen3Config defaults head_dim to 128 instead of deriving it.
        raise ValueError("a Qwen3 config can leave head_dim out only when it is 128")
    config.pop("head_dim", None)


def _check(config: dict) -> None:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if "head_dim" not in config and config["hidden_size"] % heads:
        raise ValueError("without head_dim, hidden_size must be a multiple of num_attention_heads")
    if config["vocab_size"] < TOKENIZER_SIZE:
        raise ValueError(f"vocab_size must be at least the tokenizer's {TOKENIZER_SIZE} tokens")
    if (
        config["model_type"] == "qwen3_moe"
        and not 1 <= config["num_experts_per_tok"] <= config["num_experts"]
    ):
        raise ValueError("num_experts_per_tok must be between 1 and num_experts")


def _hf5_layout(config: dict) -> dict:
    config = dict(config)
    rope = config.pop("rope_scaling", None) or {"rope_type": "default"}
    config["rope_parameters"] = {**rope, "rope_theta": config.pop("rope_theta")}
    config["dtype"] = config.pop("torch_dtype")
    if "num_experts" in config:
        config["num_local_experts"] = config.pop("num_experts")
    return config


def param_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of the model that config describes."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    qkv_bias = config.get("attention_bias", False) or config["model_type"] == "qwen2"
    o_bias = config.get("attention_bias", False)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes[prefix + "input_layernorm.weight"] = (hidden,)
        for proj, rows in (
            ("q", heads * head_dim),
            ("k", kv_heads * head_dim),
            ("v", kv_heads * head_dim),
        ):
            shapes[f"{prefix}self_attn.{proj}_proj.weight"] = (rows, hidden)
            if qkv_bias:
                shapes[f"{prefix}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[prefix + "self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if o_bias:
            shapes[prefix + "self_attn.o_proj.bias"] = (hidden,)
        if config["model_type"] in QK_NORM:
            shapes[prefix + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[prefix + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
        if is_moe_layer(
            config, layer
        ):  # the router, then one SwiGLU MLP per expert, as the hub names them
            experts, width = (
                config.get("num_experts", config.get("num_local_experts")),
                config["moe_intermediate_size"],
            )
            shapes[prefix + "mlp.gate.weight"] = (experts, hidden)
            for e in range(experts):
                shapes[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = (width, hidden)
                shapes[f"{prefix}mlp.experts.{e}.up_proj.weight"] = (width, hidden)
                shapes[f"{prefix}mlp.experts.{e}.down_proj.weight"] = (hidden, width)
        else:
            shapes[prefix + "mlp.gate_proj.weight"] = (inter, hidden)
            shapes[prefix + "mlp.up_proj.weight"] = (inter, hidden)
            shapes[prefix + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def is_moe_layer(config: dict, layer: int) -> bool:
    """Does layer `layer` of a qwen3_moe config hold experts (transformers' rule)?"""
    experts = config.get("num_experts", config.get("num_local_experts")) or 0
    return (
        config["model_type"] == "qwen3_moe"
        and experts > 0
        and layer not in (config.get("mlp_only_layers") or [])
        and (layer + 1) % config.get("decoder_sparse_step", 1) == 0
    )


def make_model(
    out_dir: str | Path,
    arch: str | None = None,
    shape: str = "tiny",
    seed: int = 0,
    *,
    device: str = "cpu",
    **overrides,
) -> Path:
    """Write a Hugging Face model directory with random weights and return its path.

    overrides: the keyword arguments of build_config (tie_word_embeddings, head_dim,
    rope_scaling, config_layout, dtype, num_hidden_layers, init_std, ...). The weights are
    drawn tensor by tensor on device ("cuda" makes the full shapes fast), so the same seed
    and device give the same bytes; CPU and CUDA draw different numbers.
    """
    return _make_model(out_dir, arch, shape, seed, device=device, **overrides)


def _make_model(
    out_dir, arch, shape, seed, *, device, report_as: Path | None = None, **overrides
) -> Path:
    """make_model; its closing line names report_as (where the model will end up) if given."""
    start = time.perf_counter()
    config = build_config(arch, shape, **overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RECORD_FILE).unlink(missing_ok=True)  # until the new files are all written
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(shape))
    save_tokenizer(out_dir, config["max_position_embeddings"])
    params = _write_weights(out_dir, config, seed, torch.device(device))
    _write_json(out_dir / RECORD_FILE, _record(config, shape, seed, device))
    print(
        f"tiny_model: {shape} {config['model_type']} model, {params / 1e6:.1f}M parameters, "
        f"in {report_as or out_dir} ({time.perf_counter() - start:.1f} s)"
    )
    return out_dir


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _generation_config(shape: str) -> dict:
    shipped = CONFIG_DIR / shape / "generation_config.json"
    config = json.loads(shipped.read_text()) if shipped.exists() else {}
    # Two EOS ids, as Qwen3 ships: the chat turn's end and the document's end.
    return config | {
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
    }


def train_bpe(texts: list[str], vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on texts, with the special tokens <|endoftext|>,
    <|im_start|> and <|im_end|> as ids 0, 1, 2; returns its tokenizer.json text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte has a token
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()


@cache
def _trained_tokenizer() -> str:
    """Train the tiny models' tokenizer once per process; returns its tokenizer.json text."""
    return train_bpe([CORPUS], TOKENIZER_SIZE)


def save_tokenizer(out_dir: Path, model_max_length: int, tokenizer_json: str | None = None) -> None:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json with the ChatML chat
    template) for tokenizer_json, by default the tiny models' tokenizer."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json or _trained_tokenizer()),
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )
    # save_jinja_files=False keeps chat_template in tokenizer_config.json, as Qwen3 ships it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def _write_weights(out_dir: Path, config: dict, seed: int, device: torch.device) -> int:
    """Write model.safetensors, or shards and their index; returns the parameter count."""
    dtype = getattr(torch, config.get("torch_dtype") or config["dtype"])
    std = config["initializer_range"]
    shapes = param_shapes(config)
    shards = _shard_plan(shapes, dtype.itemsize)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    generator = torch.Generator(device).manual_seed(seed)
    weight_map = {}
    for file, names in zip(files, shards):
        start = time.perf_counter()
        tensors = {
            name: _random_tensor(name, shapes[name], std, dtype, generator) for name in names
        }
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        size = sum(t.nbytes for t in tensors.values())
        print(
            f"tiny_model: wrote {file} ({size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)"
        )
    params = sum(math.prod(shape) for shape in shapes.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": params * dtype.itemsize}, "weight_map": weight_map}
        _write_json(out_dir / "model.safetensors.index.json", index)
    return params


def _shard_plan(shapes: dict[str, tuple[int, ...]], itemsize: int) -> list[list[str]]:
    """Group parameter names, in order, into files of at most MAX_SHARD_BYTES."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _random_tensor(
    name: str, shape: tuple[int, ...], std: float, dtype: torch.dtype, generator: torch.Generator
) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype, device=generator.device)
    tensor.normal_(0.0, std, generator=generator)
    if name.endswith("norm.weight"):  # RMSNorm gains: one plus noise
        tensor += 1.0
    return tensor.cpu()


def _record(config: dict, shape: str, seed: int, device: str) -> dict:
    """What identifies a built model: equal records, equal files."""
    record = {
        "factory_version": FACTORY_VERSION,
        "shape": shape,
        "seed": seed,
        "device": str(device),
        "config": config,
    }
    return json.loads(json.dumps(record))


def cached_model(name: str, **kwargs) -> Path:
    """build_if_missing(<repo>/.models/<name>, **kwargs): for notebooks, demos and benchmarks."""
    return build_if_missing(MODELS_DIR / name, **kwargs)


def build_if_missing(
    out_dir: str | Path,
    arch: str | None = None,
    shape: str = "tiny",
    seed: int = 0,
    *,
    device: str = "cpu",
    **overrides,
) -> Path:
    """make_model(out_dir, ...) unless out_dir already holds that very model.

    A directory that make_model built with other arguments, or an older factory, is
    replaced; any other non-empty directory is left alone (FileExistsError). The build goes
    to a temporary sibling directory, renamed into place when complete, so an interrupted
    build never leaves a half-written model behind.
    """
    out_dir = Path(out_dir)
    record = _record(build_config(arch, shape, **overrides), shape, seed, device)
    found = _read_record(out_dir)
    if found == record:
        return out_dir
    if found is None and out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and was not made by tools.tiny_model")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as tmp:
        build = _make_model(
            Path(tmp) / out_dir.name,
            arch,
            shape,
            seed,
            device=device,
            report_as=out_dir,
            **overrides,
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)  # made with other arguments or by an older factory
        try:
            build.rename(out_dir)
        except OSError:  # another process has just put the same model in place
            if _read_record(out_dir) != record:
                raise
    return out_dir


def _read_record(model_dir: Path) -> dict | None:
    path = model_dir / RECORD_FILE
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write a random-weight Hugging Face model directory."
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--arch", choices=tuple(ARCHITECTURES), help="default: qwen3, or the shape's own"
    )
    parser.add_argument("--shape", default="tiny", choices=("tiny", *FULL_SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    head = parser.add_mutually_exclusive_group()
    head.add_argument("--tied", dest="tie_word_embeddings", action="store_true", default=None)
    head.add_argument("--untied", dest="tie_word_embeddings", action="store_false")
    parser.add_argument("--mha", action="store_true", help="as many KV heads as query heads")
    parser.add_argument(
        "--derive-head-dim", action="store_true", help="leave head_dim out of config.json"
    )
    parser.add_argument("--rope-scaling", choices=("llama3",))
    parser.add_argument("--attention-bias", action="store_true", default=None)
    parser.add_argument("--layout", dest="config_layout", default="hf4", choices=("hf4", "hf5"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--if-missing",
        action="store_true",
        help="keep OUT_DIR if it already holds this model; build atomically otherwise",
    )
    args = vars(parser.parse_args(argv))
    if args.pop("mha"):
        args["num_key_value_heads"] = build_config(args["arch"], args["shape"])[
            "num_attention_heads"
        ]
    build = build_if_missing if args.pop("if_missing") else make_model
    build(args.pop("out_dir"), **args)


if __name__ == "__main__":
    main()
