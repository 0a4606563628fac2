"""Checks for 07_tensor_parallel.ipynb: a row-parallel linear and its all-reduce, simulated with
one tensor shard per rank, and which rows of the fused QKV weight each rank holds."""

import contextlib

import torch

from . import stage
from .report import expect_close, expect_equal, fail

STAGE = "07_tensor_parallel"


@contextlib.contextmanager
def as_rank(rank: int, size: int):
    """Layers built inside take rank `rank` of `size`'s shard (the stage's set_tp_rank)."""
    parallel = stage.module(STAGE, "distributed")
    parallel.set_tp_rank(rank, size)
    try:
        yield
    finally:
        parallel.set_tp_rank(0, 1)


def stage_row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tp_size: int):
    """Each rank's RowParallelLinear (built and loaded by the stage) on its slice of x, before the
    all-reduce; and the stage's unsharded Linear on the whole x."""
    linear = stage.module(STAGE, "layers.linear")
    full = linear.Linear(weight.shape[1], weight.shape[0], bias=True)
    full.weight.weight_loader(full.weight, weight)
    full.bias.weight_loader(full.bias, bias)
    partials = []
    original = linear.all_reduce
    linear.all_reduce = lambda t: t  # keep each rank's partial sum: no process group here
    try:
        for rank in range(tp_size):
            with as_rank(rank, tp_size):
                layer = linear.RowParallelLinear(weight.shape[1], weight.shape[0], bias=True)
            layer.weight.weight_loader(layer.weight, weight)  # the stage keeps this rank's columns
            layer.bias.weight_loader(layer.bias, bias)
            width = layer.weight.shape[1]
            partials.append(layer(x[:, rank * width : (rank + 1) * width]))  # this rank's input slice
    finally:
        linear.all_reduce = original
    return partials, full(x)


def check_row_parallel_linear(row_parallel_linear) -> str:
    """row_parallel_linear(x, weight, bias, tp_size) -> (partials, y): each rank's partial output
    (its slice of x's columns times its slice of W's columns; the bias on rank 0 only), and their
    all-reduce (the sum). Compared with the stage's RowParallelLinear on each rank, and with the
    unsharded linear."""
    g = torch.Generator().manual_seed(10)
    for tokens, in_features, out_features, tp_size in ((3, 8, 6, 2), (5, 12, 4, 4), (2, 6, 5, 1), (4, 16, 8, 2)):
        x = torch.randn(tokens, in_features, generator=g)
        weight = torch.randn(out_features, in_features, generator=g)
        bias = torch.randn(out_features, generator=g)
        with torch.no_grad():
            expected_partials, expected = stage_row_parallel(x, weight, bias, tp_size)
        got = row_parallel_linear(x.clone(), weight.clone(), bias.clone(), tp_size)
        shapes = dict(x=tuple(x.shape), weight=tuple(weight.shape), tp_size=tp_size)
        if not isinstance(got, (tuple, list)) or len(got) != 2 or len(got[0]) != tp_size:
            fail("return (partials, y): a list of tp_size partial outputs, and their sum", **shapes)
        partials, y = got
        for rank, (mine, theirs) in enumerate(zip(partials, expected_partials)):
            expect_close(mine, theirs, f"rank {rank}'s partial output differs from the stage's RowParallelLinear on "
                         f"rank {rank} (rank r multiplies input columns r*in/tp .. (r+1)*in/tp of x and of W; "
                         "only rank 0 adds the bias)", atol=1e-5, **shapes)
        expect_close(y, expected, "the all-reduced output differs from the unsharded linear x @ W.T + b "
                     "(the all-reduce sums the partial outputs)", atol=1e-5, **shapes)
    return "each rank's partial output matches the stage's RowParallelLinear, and their sum the unsharded linear (TP = 1, 2, 4)"


def stage_qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, tp_size: int) -> list[int]:
    """Load a fused QKV weight whose row i holds the number i into the stage's QKVParallelLinear
    on `rank`, and read back which rows it kept."""
    linear = stage.module(STAGE, "layers.linear")
    with as_rank(rank, tp_size):
        layer = linear.QKVParallelLinear(1, head_dim, num_heads, num_kv_heads)
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    rows = torch.arange(q + 2 * kv, dtype=torch.float32).unsqueeze(1)  # (q + 2 kv, hidden=1): row i holds i
    with torch.no_grad():
        for shard, part in zip("qkv", rows.split([q, kv, kv])):  # the checkpoint's q_proj, k_proj, v_proj
            layer.weight.weight_loader(layer.weight, part, shard)
    return layer.weight[:, 0].long().tolist()


QKV_CASES = [(4, 2, 2, 2), (8, 2, 3, 2), (4, 4, 1, 4), (6, 2, 2, 2), (4, 2, 2, 1), (8, 4, 2, 4)]


def check_qkv_rows(qkv_rows) -> str:
    """qkv_rows(num_heads, num_kv_heads, head_dim, rank, tp_size) -> the rows of the full fused
    [q | k | v] weight that `rank` holds, in its order. Compared with the stage's QKVParallelLinear."""
    checked = 0
    for num_heads, num_kv_heads, head_dim, tp_size in QKV_CASES:
        for rank in range(tp_size):
            expected = stage_qkv_rows(num_heads, num_kv_heads, head_dim, rank, tp_size)
            got = qkv_rows(num_heads, num_kv_heads, head_dim, rank, tp_size)
            expect_equal(got, expected, "the rows differ from those the stage's QKVParallelLinear keeps (each rank "
                         "takes its own query heads from q, and its own KV heads from k and from v)",
                         num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rank=rank, tp_size=tp_size)
            checked += 1
    return f"the same rows as the stage's QKVParallelLinear on {checked} ranks (TP = 1, 2, 4; GQA and MHA)"


def stage_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, tp_size: int):
    """Each rank's MLP (built and loaded by the stage: merged column-parallel gate_up, row-parallel
    down) on the whole x, before the all-reduce; and the stage's unsharded MLP."""
    from types import SimpleNamespace

    MLP = stage.module(STAGE, "models.transformer").MLP
    linear = stage.module(STAGE, "layers.linear")
    cfg = SimpleNamespace(hidden_size=gate.shape[1], intermediate_size=gate.shape[0])
    original, outs = linear.all_reduce, []
    linear.all_reduce = lambda t: t  # keep each rank's partial sum
    try:
        for rank in [*range(tp_size), None]:
            with as_rank(rank or 0, 1 if rank is None else tp_size):
                mlp = MLP(cfg)
            mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, gate, 0)
            mlp.gate_up_proj.weight.weight_loader(mlp.gate_up_proj.weight, up, 1)
            mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, down)
            outs.append(mlp(x))
    finally:
        linear.all_reduce = original
    return outs[:-1], outs[-1]


def check_tp_mlp(tp_mlp) -> str:
    """STRETCH. tp_mlp(x, gate, up, down, tp_size) -> (partials, y): a tensor-parallel SwiGLU MLP,
    simulated with one tensor slice per rank. gate and up are (intermediate, hidden), down is
    (hidden, intermediate); y = down(silu(x gate^T) * (x up^T)). Rank r holds rows r*I/tp ..
    (r+1)*I/tp of gate and of up (merged column-parallel: no communication) and the same columns
    of down (row-parallel): its partial output is (tokens, hidden), and the all-reduce sums them.
    Compared with the stage's MLP built on each rank and with its unsharded MLP."""
    g = torch.Generator().manual_seed(16)
    for tokens, hidden, inter, tp_size in ((3, 8, 12, 2), (2, 6, 16, 4), (4, 8, 10, 1), (5, 16, 24, 2)):
        x = torch.randn(tokens, hidden, generator=g)
        gate, up = torch.randn(inter, hidden, generator=g), torch.randn(inter, hidden, generator=g)
        down = torch.randn(hidden, inter, generator=g)
        with torch.no_grad():
            expected_partials, expected = stage_mlp(x, gate, up, down, tp_size)
        got = tp_mlp(x.clone(), gate.clone(), up.clone(), down.clone(), tp_size)
        shapes = dict(x=tuple(x.shape), gate=tuple(gate.shape), down=tuple(down.shape), tp_size=tp_size)
        if not isinstance(got, (tuple, list)) or len(got) != 2 or len(got[0]) != tp_size:
            fail("return (partials, y): a list of tp_size partial outputs, and their sum", **shapes)
        for rank, (mine, theirs) in enumerate(zip(got[0], expected_partials)):
            expect_close(mine, theirs, f"rank {rank}'s partial output differs from the stage's MLP on rank {rank} "
                         "(its own rows of gate AND of up, the same columns of down)", atol=1e-4, **shapes)
        expect_close(got[1], expected, "the all-reduced output differs from the unsharded MLP", atol=1e-4, **shapes)
    return "each rank's partial output matches the stage's MLP on that rank, and their sum the unsharded MLP (TP = 1, 2, 4)"
