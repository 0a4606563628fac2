"""Decode steps captured as CUDA graphs, one per batch size of a ladder, and replayed.

A graph replays every kernel launch of a step with one call, on fixed buffers: a decode
step of n sequences copies its inputs into the first n rows of the buffers and replays
the graph of the next captured size up (the padding rows store nothing and attend to
nothing)."""

import torch
from torch import nn

from ..layers.context import Context, set_context
from .block_manager import blocks_needed


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to
    max_num_seqs (at most 512), and max_num_seqs itself."""
    max_bs = min(max_num_seqs, 512)
    return sorted({bs for bs in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if bs <= max_bs} | {max_bs})


def graph_for(num_seqs: int, sizes: list[int]) -> int:
    """The captured size a decode step of `num_seqs` sequences is padded up to."""
    return next(size for size in sizes if size >= num_seqs)


class CUDAGraphs:
    @torch.inference_mode()  # the buffers are inference tensors, as everything a step touches
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.sizes = graph_batch_sizes(max_num_seqs)
        max_bs, max_blocks = self.sizes[-1], blocks_needed(max_model_len, block_size)
        self.inputs = {  # static buffers shared by every graph; a graph of size bs uses the first bs rows
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=device),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=device),
            "block_tables": torch.full((max_bs, max_blocks), -1, dtype=torch.int32, device=device),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            "decode_order": torch.arange(max_bs, dtype=torch.int32, device=device),
        }
        self.identity = torch.arange(max_bs, dtype=torch.int32, device=device)  # the padding rows' order
        self.output = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> graph
        self.num_replays = 0

    @torch.inference_mode()  # no autograd records: the graphs' memory pool holds only what a step needs
    def capture(self, model: nn.Module) -> None:
        """Record one decode step of `model` per batch size of the ladder."""
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
            graph = torch.cuda.CUDAGraph()
            set_context(self.context(bs))
            ids, pos = self.inputs["input_ids"][:bs], self.inputs["positions"][:bs]
            self.output[:bs] = model(ids, pos)  # warm-up: autotuning and allocations happen outside the graph
            with torch.cuda.graph(graph, pool):
                self.output[:bs] = model(ids, pos)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        set_context(None)

    def context(self, bs: int) -> Context:
        g = self.inputs
        return Context(
            cu_seqlens_q=g["cu_seqlens_q"][: bs + 1],
            slot_mapping=g["slot_mapping"][:bs],
            context_lens=g["context_lens"][:bs],
            block_tables=g["block_tables"][:bs],
            max_seqlen_q=1,
            is_decode=True,
            decode_order=g["decode_order"][:bs],
        )

    def can_replay(self, context: Context, num_seqs: int) -> bool:
        return context.is_decode and bool(self.graphs) and num_seqs <= self.sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        n = len(input_ids)
        bs = graph_for(n, self.sizes)  # pad the batch up to a captured size
        g = self.inputs
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"][:bs].fill_(-1)  # padding rows store nothing ...
        g["slot_mapping"][:n] = context.slot_mapping
        g["context_lens"][:bs].zero_()  # ... and attend to nothing
        g["context_lens"][:n] = context.context_lens
        width = context.block_tables.shape[1]
        g["block_tables"][:n, :width] = context.block_tables
        g["decode_order"][n:bs] = self.identity[n:bs]  # padding rows last, each once
        g["decode_order"][:n] = context.decode_order
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.output[:n]  # (seqs, hidden)
