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
