"""Reference solutions for 07_tensor_parallel.ipynb."""

import torch


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tp_size: int):
    # x: (tokens, in); weight: (out, in); bias: (out,)
    width = weight.shape[1] // tp_size  # each rank's share of the input features
    partials = []
    for rank in range(tp_size):
        cols = slice(rank * width, (rank + 1) * width)
        partial = x[:, cols] @ weight[:, cols].T  # (tokens, out): a partial sum over this rank's inputs
        if rank == 0:
            partial = partial + bias  # the bias is added once, not once per rank
        partials.append(partial)
    return partials, torch.stack(partials).sum(dim=0)  # the all-reduce: every rank gets the sum


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, rank: int, tp_size: int) -> list[int]:
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    q_share, kv_share = q // tp_size, kv // tp_size
    rows = list(range(rank * q_share, (rank + 1) * q_share))  # this rank's query heads
    rows += [q + i for i in range(rank * kv_share, (rank + 1) * kv_share)]  # its KV heads, in k
    rows += [q + kv + i for i in range(rank * kv_share, (rank + 1) * kv_share)]  # and in v
    return rows


def tp_mlp(x, gate, up, down, tp_size: int):
    # x: (tokens, hidden); gate, up: (inter, hidden); down: (hidden, inter)
    share = gate.shape[0] // tp_size  # each rank's slice of the intermediate dimension
    partials = []
    for rank in range(tp_size):
        rows = slice(rank * share, (rank + 1) * share)
        gate_up = torch.cat([gate[rows], up[rows]])  # (2 share, hidden): this rank's [gate | up] rows
        h = x @ gate_up.T  # (tokens, 2 share), no communication
        g, u = h.chunk(2, dim=-1)
        partials.append((torch.nn.functional.silu(g) * u) @ down[:, rows].T)  # (tokens, hidden): a partial sum
    return partials, torch.stack(partials).sum(dim=0)  # the all-reduce
