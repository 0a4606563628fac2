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
