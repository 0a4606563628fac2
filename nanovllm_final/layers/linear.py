import torch
from torch import nn

from ..distributed import all_reduce, divide, get_tp_rank, get_tp_size
from ..kernels import dispatch
from . import cpu_linear


class Linear(nn.Module):
    """y = x W^T (+ b). Each parameter carries a `weight_loader` that copies a
    checkpoint tensor into it; fused layers below override it to fill one slice.

    Tensor parallelism: `tp_dim` says which dimension of W is split across the
    ranks: None (every rank holds all of W), 0 (column parallel: rank r holds a block of
    output rows) or 1 (row parallel: a block of input columns). The loader always
    receives the full checkpoint tensor and keeps this rank's block.

    `gemv_kind` names the projection kind (linear, gate_up or down: kernels/tuning.py) whose
    few-row kernels take a few rows of x."""

    tp_dim: int | None = None

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, gemv_kind: str = "linear"
    ):
        super().__init__()
        self.gemv_kind = gemv_kind
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if self.tp_dim == 0:
            out_features = divide(out_features, "output features")
        elif self.tp_dim == 1:
            in_features = divide(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # this rank's shard
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        target = param.data if shard_id is None else self.shard(param.data, shard_id)
        loaded = self.rank_part(param, loaded)
        if target.shape != loaded.shape:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter slice of shape {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def rank_part(self, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full checkpoint tensor.
        A column-parallel bias is split like the rows; a row-parallel bias is whole."""
        dim = self.tp_dim if param is self.weight else (0 if self.tp_dim == 0 else None)
        if dim is None or self.tp_size == 1:
            return loaded
        size = loaded.shape[dim] // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def shard(self, data: torch.Tensor, shard_id) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} is not a fused layer (got shard {shard_id!r})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias): on CUDA, a few rows without a bias take the matrix-vector kernels
        (kernels/gemv.py: cuBLAS's kernels for a few rows are far from the memory bound), else F.linear."""
        if bias is None and dispatch.takes_gemv(x, self.gemv_kind):
            return dispatch.gemv.gemv(x, self.weight, kind=self.gemv_kind)
        return cpu_linear.linear(
            x, self.weight, bias
        )  # F.linear; on an AMD CPU through oneDNN for 2+ rows


class ColumnParallelLinear(Linear):
    """W's output rows are split across ranks. Each rank
    computes its own slice of y (tokens, out / tp) from the full x; no communication."""

    tp_dim = 0


class RowParallelLinear(Linear):
    """W's input columns are split across ranks. Each rank
    multiplies its slice of x (tokens, in / tp), typically the output of a column-parallel
    layer, and the partial sums are added up over the ranks (all-reduce)."""

    tp_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None  # added once, not once per rank
        return self.reduce(self.matmul(x, bias))

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' partial outputs summed: (tokens, out), the same on every rank."""
        return all_reduce(y) if self.tp_size > 1 else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input in one matmul (gate_proj and up_proj).
    Shard i of the checkpoint fills rows [sum(sizes[:i]), sum(sizes[:i+1])).
    Every projection is split across ranks, so rank r holds
    [gate rows of rank r | up rows of rank r]: sizes[i] / tp rows of each."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        gemv_kind: str = "linear",
    ):
        super().__init__(in_features, sum(output_sizes), bias, gemv_kind)
        self.output_sizes = [divide(size, "output features") for size in output_sizes]  # per rank

    def shard(self, data: torch.Tensor, shard_id: int) -> torch.Tensor:
        start = sum(self.output_sizes[:shard_id])
        return data.narrow(0, start, self.output_sizes[shard_id])


class QKVParallelLinear(MergedColumnParallelLinear):
    """q_proj, k_proj and v_proj fused: rows are [q (heads*d) | k (kv_heads*d) | v (kv_heads*d)].

    Split by heads, so rank r holds heads/tp query heads and kv_heads/tp key/value heads:
    a whole GQA group stays on one rank. Sizes are the model's totals; this layer divides
    them, and `num_heads` / `num_kv_heads` are this rank's counts (the one place they are
    computed: attention and the KV cache read them from here)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias)
        self.num_heads, self.num_kv_heads = (
            divide(num_heads, "num_attention_heads"),
            divide(num_kv_heads, "num_key_value_heads"),
        )

    def shard(self, data: torch.Tensor, shard_id: str) -> torch.Tensor:
        return super().shard(data, "qkv".index(shard_id))
