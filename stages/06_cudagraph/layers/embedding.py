import torch
import torch.nn.functional as F
from torch import nn


class Embedding(nn.Module):
    """Token embedding table (vocab, hidden)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # (tokens, hidden)


class LMHead(Embedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)  # (seqs, vocab)
