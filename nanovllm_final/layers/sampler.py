import torch
from torch import nn


class Sampler(nn.Module):
    """Greedy for temperature 0, Gumbel-max sampling otherwise.

    Gumbel-max: argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability
    p_i, because -log E_i is Gumbel noise and argmax(log p_i + Gumbel_i) ~ p. One
    batched argmax, no sorting and no cumulative sums."""

    def __init__(self, seed: int, device: torch.device):
        super().__init__()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        logits = logits.float()  # (seqs, vocab)
        greedy = logits.argmax(dim=-1)  # (seqs,)
        safe_t = temperatures.clamp(min=1e-5).unsqueeze(1)  # (seqs, 1)
        probs = torch.softmax(logits / safe_t, dim=-1)  # (seqs, vocab)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)  # Exp(1)
        sampled = (probs / noise).argmax(dim=-1)  # (seqs,)
        return torch.where(temperatures == 0, greedy, sampled)
