"""Reference solutions for 01_naive.ipynb."""

import torch


def naive_generate(next_logits, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = next_logits(ids)  # (vocab,): the whole sequence goes through the model, every step
        ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def gumbel_max(logits: torch.Tensor, temperatures: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    # logits, uniform: (rows, vocab); temperatures: (rows,)
    probs = torch.softmax(logits / temperatures.clamp(min=1e-5).unsqueeze(1), dim=-1)  # (rows, vocab)
    noise = -torch.log(uniform)  # Exp(1): -log of a uniform draw
    sampled = (probs / noise).argmax(dim=-1)  # (rows,)
    return torch.where(temperatures == 0, logits.argmax(dim=-1), sampled)


def filter_probs(logits, temperatures, top_k, top_p, min_p) -> torch.Tensor:
    # logits: (rows, vocab); temperatures, top_k, top_p, min_p: (rows,)
    probs = torch.softmax(logits / temperatures.unsqueeze(1), dim=-1)  # (rows, vocab)
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)  # (rows, vocab), most likely first
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)  # (rows, 1): 0 means all
    keep = torch.arange(vocab) < k  # (rows, vocab), in sorted order
    kept = sorted_p * keep  # the mass top_k kept
    before = kept.cumsum(-1) - kept  # (rows, vocab): mass of the more likely kept tokens
    keep &= (before < top_p.unsqueeze(1) * kept.sum(-1, keepdim=True)) | (top_p >= 1).unsqueeze(1)
    keep = torch.zeros_like(keep).scatter(-1, order, keep)  # back to vocabulary order
    keep &= probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    masked = probs * keep
    return masked / masked.sum(-1, keepdim=True)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # router_logits: (tokens, experts)
    probs = torch.softmax(router_logits.float(), dim=-1)  # (tokens, experts): over all experts, in float32
    weights, expert_ids = probs.topk(top_k, dim=-1)  # (tokens, top_k) each, most likely first
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # the kept weights sum to 1
    return weights.to(router_logits.dtype), expert_ids


def expert_load(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    # expert_ids: (tokens, top_k) -> (num_experts,): every (token, slot) pair counts once for its expert
    return torch.bincount(expert_ids.flatten(), minlength=num_experts)
