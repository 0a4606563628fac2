"""Mixture of experts (Qwen3-MoE): a router sends each token to `top_k` of `num_experts`
SwiGLU MLPs and adds up their outputs, weighted by the router's probabilities.

On CUDA the router is one Triton kernel and the experts run as two grouped GEMMs, or two
matrix-vector kernels for a few tokens (kernels/moe.py); route_torch and the loop over the
experts below are the reference and the CPU path. Tensor parallelism splits every expert
like a dense MLP, along its intermediate dimension, and sums the ranks' outputs once per layer."""

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_reduce, divide, get_tp_rank, get_tp_size
from ..kernels import dispatch
from .activation import SiluAndMul


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits (tokens, experts) -> weights (tokens, top_k) in the logits' dtype, expert_ids
    (tokens, top_k) int64, heaviest first: kernels/moe.py's fused_route on CUDA (one launch), else route_torch."""
    if dispatch.use_kernel(router_logits):
        return dispatch.moe.fused_route(router_logits, top_k, renormalize)
    return route_torch(router_logits, top_k, renormalize)


def route_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts and their weights: a softmax over all experts (in float32),
    the `top_k` largest kept and, with `renormalize` (norm_topk_prob), scaled to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (tokens, experts)
    weights, expert_ids = probs.topk(top_k, dim=-1)  # (tokens, top_k) each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


class Experts(nn.Module):
    """Stacked expert weights: `gate_up_proj` (experts, 2 * inter / tp, hidden) holds each expert's
    [gate | up] rows of this rank, `down_proj` is (experts, hidden, inter / tp). The loader hands
    `weight_loader` one full checkpoint tensor per expert and projection, shard id
    (e, "gate" | "up" | "down"); `shard_ids` lists every piece that must arrive."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.intermediate_size = (
            num_experts,
            divide(intermediate_size, "moe_intermediate_size"),
        )
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size))
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.weight_loader = self.weight_loader
            param.shard_ids = {(e, part) for e in range(num_experts) for part in parts}
        self.act = SiluAndMul()

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str] | None
    ) -> None:
        if shard_id is None:
            raise ValueError(
                "expert weights are loaded one expert at a time (mlp.experts.<e>.gate_proj.weight, ...)"
            )
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(
                f"the checkpoint has weights for expert {expert}, but config.json says num_experts={self.num_experts}"
            )
        size = self.intermediate_size
        loaded = (
            loaded.narrow(1 if part == "down" else 0, self.tp_rank * size, size)
            if self.tp_size > 1
            else loaded
        )
        target = param.data[expert]  # (2 * inter / tp, hidden) or (hidden, inter / tp)
        if part != "down":
            target = target.narrow(0, 0 if part == "gate" else size, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert {expert} {part}_proj: checkpoint shape {tuple(loaded.shape)} != model shape {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x: (tokens, hidden); weights, expert_ids: (tokens, top_k) -> (tokens, hidden)."""
        if dispatch.use_kernel(x):
            out = dispatch.moe.fused_experts(
                x, self.gate_up_proj, self.down_proj, weights, expert_ids
            )
        else:
            out = self.forward_loop(x, weights, expert_ids)
        return all_reduce(out) if self.tp_size > 1 else out

    def forward_loop(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in (
            expert_ids.unique().tolist()
        ):  # the experts that received tokens (a host sync: not capturable)
            token, slot = torch.where(
                expert_ids == e
            )  # (n,) each: token[i] chose e as its slot[i]-th expert
            h = self.act(
                F.linear(x[token], self.gate_up_proj[e])
            )  # (n, 2 * inter / tp) -> (n, inter / tp)
            out.index_add_(
                0, token, F.linear(h, self.down_proj[e]) * weights[token, slot, None]
            )  # (n, hidden)
        return out
