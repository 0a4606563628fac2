"""Mixture of experts (Qwen3-MoE): a router sends each token to `top_k` of `num_experts`
SwiGLU MLPs and adds up their outputs, weighted by the router's probabilities.

This is the plain version, the reference for every faster one: one loop over the experts
that received tokens, each running its MLP on just those tokens."""

import torch
import torch.nn.functional as F
from torch import nn

from .activation import SiluAndMul


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts and their weights: a softmax over all experts (in float32),
    the `top_k` largest kept and, with `renormalize` (config.json's norm_topk_prob), scaled to sum to 1."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (tokens, experts)
    weights, expert_ids = probs.topk(top_k, dim=-1)  # (tokens, top_k) each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), expert_ids


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs with their weights stacked: `gate_up_proj` (experts, 2 * inter,
    hidden) holds each expert's [gate | up] rows, `down_proj` is (experts, hidden, inter).

    The checkpoint stores one tensor per expert and projection
    (`mlp.experts.<e>.gate_proj.weight`, ...); the loader hands each to `weight_loader` with
    shard id (e, "gate" | "up" | "down"), and `shard_ids` lists every piece that must arrive."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
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
        target = param.data[expert]  # (2 * inter, hidden) or (hidden, inter)
        if part != "down":
            target = target.narrow(
                0, 0 if part == "gate" else self.intermediate_size, self.intermediate_size
            )
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert {expert} {part}_proj: checkpoint shape {tuple(loaded.shape)} != model shape {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x: (tokens, hidden); weights, expert_ids: (tokens, top_k) -> (tokens, hidden)."""
        out = torch.zeros_like(x)
        for (
            e
        ) in expert_ids.unique().tolist():  # the experts that received tokens, in increasing order
            token, slot = torch.where(
                expert_ids == e
            )  # (n,) each: token[i] chose e as its slot[i]-th expert
            h = self.act(F.linear(x[token], self.gate_up_proj[e]))  # (n, 2 * inter) -> (n, inter)
            y = F.linear(h, self.down_proj[e])  # (n, hidden)
            out.index_add_(0, token, y * weights[token, slot, None])
        return out
