import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_reduce, divide, gather_to_first, get_tp_rank, get_tp_size
from . import cpu_linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding table (vocab, hidden).

    The vocabulary is split across ranks; rank r holds rows
    [r * vocab/tp, (r+1) * vocab/tp). Each rank looks up the ids it holds, writes zeros
    for the others, and an all-reduce sums the ranks' rows into the full embedding."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = divide(vocab_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size)
        )  # (vocab / tp, hidden)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit an embedding of shape {(self.vocab_size, param.shape[1])}"
            )
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.rows_per_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # (tokens, hidden)
        local = input_ids - self.vocab_start  # (tokens,) row in this rank's shard
        mine = (local >= 0) & (local < self.rows_per_rank)  # (tokens,) ids this rank holds
        x = F.embedding(local * mine, self.weight) * mine.unsqueeze(
            1
        )  # (tokens, hidden), zeros where not mine
        return all_reduce(x)  # (tokens, hidden)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding.

    Each rank computes the logits of its vocabulary slice;
    they are gathered on rank 0, which samples. The other ranks get None."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = cpu_linear.linear(hidden, self.weight)  # (seqs, vocab / tp)
        if self.tp_size == 1:
            return logits  # (seqs, vocab)
        return gather_to_first(logits)  # (seqs, vocab) on rank 0, None elsewhere
