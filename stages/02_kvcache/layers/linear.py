import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). Each parameter carries a `weight_loader` that copies a
    checkpoint tensor into it; fused layers below override it to fill one slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        target = param.data if shard_id is None else self.shard(param.data, shard_id)
        if target.shape != loaded.shape:
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter slice of shape {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def shard(self, data: torch.Tensor, shard_id) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} is not a fused layer (got shard {shard_id!r})")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input in one matmul (gate_proj and up_proj).
    Shard i of the checkpoint fills rows [sum(sizes[:i]), sum(sizes[:i+1]))."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def shard(self, data: torch.Tensor, shard_id: int) -> torch.Tensor:
        start = sum(self.output_sizes[:shard_id])
        return data.narrow(0, start, self.output_sizes[shard_id])


class QKVLinear(MergedLinear):
    """q_proj, k_proj and v_proj fused: rows are [q (heads*d) | k (kv_heads*d) | v (kv_heads*d)]."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias)

    def shard(self, data: torch.Tensor, shard_id: str) -> torch.Tensor:
        return super().shard(data, "qkv".index(shard_id))
