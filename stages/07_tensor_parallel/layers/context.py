"""What the attention layers need to know about the current batch.

The model runner sets it before each forward pass; attention layers read it.
Models and other layers never look at it."""

from dataclasses import dataclass

import torch


@dataclass
class Context:
    cu_seqlens_q: torch.Tensor  # (seqs+1,) int32: start of each sequence in the packed token stream
    slot_mapping: (
        torch.Tensor
    )  # (tokens,) cache slot of each new token: block * block_size + offset
    context_lens: (
        torch.Tensor
    )  # (seqs,) int32: tokens of each sequence in the cache after this step's writes
    # the cache is a pool of blocks; each sequence reads its own through a table
    block_tables: torch.Tensor  # (seqs, max_blocks) int32, padded with -1
    max_seqlen_q: int  # the longest query run in the batch (sizes kernel grids)
    is_decode: bool  # every sequence feeds exactly one token


_CONTEXT: Context | None = None


def set_context(context: Context | None) -> None:
    global _CONTEXT
    _CONTEXT = context


def get_context() -> Context:
    assert _CONTEXT is not None, "attention ran outside a model runner step"
    return _CONTEXT
