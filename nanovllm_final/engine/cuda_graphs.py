"""Steps captured as CUDA graphs and replayed: decode steps, one graph per batch size of a
ladder, and steps that carry prompt tokens, one graph per token count of a second ladder.

A graph replays every kernel launch of a step with one call, on fixed buffers: a step
writes its inputs into the first rows of its ladder's buffers (in one copy, graph_inputs.py)
and replays the graph of the next captured size up (the padding rows store nothing and attend
to nothing). Eagerly, a step of
a small model is bound by the host's ~500 launches (~15 ms on a Hopper GPU at any token count up
to a few thousand, against ~2 ms for a decode step replayed), so a step that admits a new
prompt would stall every running stream for several decode steps; replayed, it costs its
GPU time. Steps with prompts need an attention backend whose prefill launch reads no
device values (`capturable_prefill`: its grid is sized from the token and sequence counts);
the option `cuda_graph_max_tokens` caps their ladder (larger steps' GPU time dwarfs their
launches), and 0 leaves them eager."""

import torch
from torch import nn

from ..layers.context import Context, set_context
from .block_manager import blocks_needed
from .graph_inputs import GraphInputs
from .step_input import StepInput


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to
    max_num_seqs (at most 512), and max_num_seqs itself."""
    max_bs = min(max_num_seqs, 512)
    return sorted(
        {bs for bs in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if bs <= max_bs} | {max_bs}
    )


def graph_token_sizes(max_tokens: int) -> list[int]:
    """The token counts of steps with prompts to capture: 16, 24, 32, 48, 64, 96, ... (powers of
    two and the points halfway between them, so that padding adds at most half) up to
    `max_tokens`, and `max_tokens` itself; none for 0."""
    ladder = {
        n
        for p in range(4, max_tokens.bit_length())
        for n in (2**p, 3 * 2 ** (p - 1))
        if n <= max_tokens
    }
    return sorted(ladder | {max_tokens}) if max_tokens > 0 else []


def graph_for(n: int, sizes: list[int]) -> int:
    """The captured size a step of `n` sequences (decode) or tokens (with prompts) is padded up to."""
    return next(size for size in sizes if size >= n)


class CUDAGraphs:
    @torch.inference_mode()  # the buffers are inference tensors, as everything a step touches
    def __init__(
        self,
        max_num_seqs: int,
        max_prompt_tokens: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """max_prompt_tokens: the largest step with prompt tokens to capture (0: none)."""
        self.sizes = graph_batch_sizes(max_num_seqs)  # decode: sequences
        self.token_sizes = graph_token_sizes(max_prompt_tokens)  # with prompts: tokens
        self.max_num_seqs = max_num_seqs
        max_tokens = max(self.token_sizes, default=0)
        max_seqs = self.seq_rows(max_tokens)
        max_blocks = blocks_needed(max_model_len, block_size)
        # the buffers each ladder's graphs read, a step written into their first rows
        self.inputs = {
            True: GraphInputs(self.sizes[-1], self.sizes[-1], max_blocks, device, decode=True),
            False: GraphInputs(max_tokens, max_seqs, max_blocks, device, decode=False),
        }
        self.identity = torch.arange(
            self.sizes[-1] + 1, dtype=torch.int32, device=device
        )  # decode's cu_seqlens_q (never read)
        self.output = torch.zeros(
            max(self.sizes[-1], max_tokens), hidden_size, dtype=dtype, device=device
        )
        self.graphs: dict[
            tuple[bool, int], torch.cuda.CUDAGraph
        ] = {}  # (is_decode, sequences or tokens) -> graph
        self.num_replays = {True: 0, False: 0}  # by is_decode

    def seq_rows(self, num_tokens: int) -> int:
        """The sequences a step of `num_tokens` tokens may hold."""
        return min(self.max_num_seqs, num_tokens)

    @torch.inference_mode()  # no autograd records: the graphs' memory pool holds only what a step needs
    def capture(self, model: nn.Module) -> None:
        """Record one step of `model` per size of each ladder; they share one memory pool (one
        step runs at a time), so the largest of all is captured first."""
        pool = None
        todo = [(False, n) for n in self.token_sizes] + [(True, bs) for bs in self.sizes]
        for key in sorted(todo, key=lambda key: key[1], reverse=True):
            is_decode, n = key
            graph = torch.cuda.CUDAGraph()
            set_context(self.context(is_decode, n))
            ids, pos = (buffer[:n] for buffer in self.token_inputs(is_decode))
            self.output[:n] = model(
                ids, pos
            )  # warm-up: autotuning and allocations happen outside the graph
            with torch.cuda.graph(graph, pool):
                self.output[:n] = model(ids, pos)
            pool = pool or graph.pool()
            self.graphs[key] = graph
            torch.cuda.synchronize()
        set_context(None)

    def token_inputs(self, is_decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The (input_ids, positions) buffers the graphs of one ladder read."""
        g = self.inputs[is_decode].views
        return g["input_ids"], g["positions"]

    def context(self, is_decode: bool, n: int) -> Context:
        """The context a graph of `n` sequences (decode) or tokens (with prompts) reads. While
        capturing, every row is padding: nothing is stored (slots -1), nothing attended to
        (context 0, and no prompt sequence has a token: cu_seqlens_q all 0)."""
        g = self.inputs[is_decode].views
        seqs = n if is_decode else self.seq_rows(n)
        return Context(
            cu_seqlens_q=self.identity[: seqs + 1]
            if is_decode
            else g["cu_seqlens_q"][: seqs + 1],  # decode: 0, 1, ..., never read
            slot_mapping=g["slot_mapping"][:n],
            context_lens=g["context_lens"][:seqs],
            block_tables=g["block_tables"][:seqs],
            max_seqlen_q=1 if is_decode else n,
            is_decode=is_decode,
            decode_order=g["decode_order"][:n] if is_decode else None,
        )

    def can_replay(self, step: StepInput) -> bool:
        """Is there a graph for this step: decode steps by sequences, steps with prompt tokens
        by tokens?"""
        sizes = self.ladder(step)
        return bool(self.graphs) and bool(sizes) and step.num_tokens <= sizes[-1]

    def write(self, step: StepInput) -> dict[str, torch.Tensor]:
        """The step's arrays into its ladder's graph inputs, in one copy (graph_inputs.py); the
        device views of its input_ids, sample_rows, carry_index and carry_rows."""
        size = self.size(step)
        rows = size if step.is_decode else self.seq_rows(size)
        return self.inputs[step.is_decode].write(step, size, rows)

    def ladder(self, step: StepInput) -> list[int]:
        """The captured sizes of the step's ladder: sequences (decode) or tokens (with prompts)."""
        return self.sizes if step.is_decode else self.token_sizes

    def size(self, step: StepInput) -> int:
        """The captured size the step is padded up to."""
        return graph_for(step.num_tokens, self.ladder(step))

    def replay(self, step: StepInput) -> torch.Tensor:
        """(tokens, hidden): the hidden states of the step `write` wrote."""
        self.graphs[(step.is_decode, self.size(step))].replay()
        self.num_replays[step.is_decode] += 1
        return self.output[: step.num_tokens]
