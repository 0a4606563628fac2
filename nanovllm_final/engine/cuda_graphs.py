"""Steps captured as CUDA graphs and replayed: decode steps, one graph per batch size of a
ladder, and steps that carry prompt tokens, one graph per token count of a second ladder. With
speculative decoding, where the attention backend's decode takes a verify step's 1 + k queries
per sequence, verify steps (at most 1 + k tokens a sequence) have a third ladder, by sequences as
decode's, each graph sized for 1 + k tokens a sequence: their attention is the decode kernel's.

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
    """The captured size a step of `n` sequences (decode, verify) or tokens (with prompts) is
    padded up to."""
    return next(size for size in sizes if size >= n)


KINDS = ("decode", "verify", "prompt")  # the ladders


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
        verify_tokens: int = 0,
        max_step_tokens: int = 0,
    ):
        """max_prompt_tokens: the largest step with prompt tokens to capture (0: none);
        verify_tokens: 1 + k, the most tokens a sequence feeds in a verify step (0: no verify
        ladder); max_step_tokens: the most tokens of a step, which caps that ladder."""
        self.verify_tokens, self.max_num_seqs = verify_tokens, max_num_seqs
        decode = graph_batch_sizes(max_num_seqs)
        self.ladders = {  # sequences (decode, verify) or tokens (with prompts)
            "decode": decode,
            "verify": [n for n in decode if 0 < n * verify_tokens <= max_step_tokens],
            "prompt": graph_token_sizes(max_prompt_tokens),
        }
        max_blocks = blocks_needed(max_model_len, block_size)
        # the buffers each ladder's graphs read, a step written into their first rows
        self.inputs = {
            kind: GraphInputs(
                self.tokens(kind, max(sizes, default=0)),
                self.seqs(kind, max(sizes, default=0)),
                max_blocks,
                device,
                decode=kind == "decode",
            )
            for kind, sizes in self.ladders.items()
        }
        self.identity = torch.arange(
            decode[-1] + 1, dtype=torch.int32, device=device
        )  # decode's cu_seqlens_q (never read)
        most = max(self.tokens(kind, max(sizes, default=0)) for kind, sizes in self.ladders.items())
        self.output = torch.zeros(most, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}  # (kind, size) -> graph
        self.num_replays = dict.fromkeys(KINDS, 0)

    def tokens(self, kind: str, size: int) -> int:
        """The tokens of a graph of the ladder `kind` and size `size`."""
        return size * self.verify_tokens if kind == "verify" else size

    def seqs(self, kind: str, size: int) -> int:
        """The sequences a graph of the ladder `kind` and size `size` may hold."""
        return min(self.max_num_seqs, size) if kind == "prompt" else size

    @torch.inference_mode()  # no autograd records: the graphs' memory pool holds only what a step needs
    def capture(self, model: nn.Module) -> None:
        """Record one step of `model` per size of each ladder; they share one memory pool (one
        step runs at a time), so the largest of all is captured first."""
        pool = None
        todo = [(kind, size) for kind, sizes in self.ladders.items() for size in sizes]
        for key in sorted(todo, key=lambda key: self.tokens(*key), reverse=True):
            graph, n = torch.cuda.CUDAGraph(), self.tokens(*key)
            set_context(self.context(*key))
            ids, pos = (buffer[:n] for buffer in self.token_inputs(key[0]))
            self.output[:n] = model(
                ids, pos
            )  # warm-up: autotuning and allocations happen outside the graph
            with torch.cuda.graph(graph, pool):
                self.output[:n] = model(ids, pos)
            pool = pool or graph.pool()
            self.graphs[key] = graph
            torch.cuda.synchronize()
        set_context(None)

    def token_inputs(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The (input_ids, positions) buffers the graphs of one ladder read."""
        g = self.inputs[kind].views
        return g["input_ids"], g["positions"]

    def context(self, kind: str, size: int) -> Context:
        """The context a graph of the ladder `kind` and size `size` reads. While capturing,
        every row is padding: nothing is stored (slots -1), nothing attended to (context 0, and
        no sequence of a step with prompts or a verify step has a token: cu_seqlens_q all 0)."""
        g, n, seqs = self.inputs[kind].views, self.tokens(kind, size), self.seqs(kind, size)
        decode = kind == "decode"
        return Context(
            cu_seqlens_q=self.identity[: seqs + 1]
            if decode
            else g["cu_seqlens_q"][: seqs + 1],  # decode: 0, 1, ..., never read
            slot_mapping=g["slot_mapping"][:n],
            context_lens=g["context_lens"][:seqs],
            block_tables=g["block_tables"][:seqs],
            max_seqlen_q={"decode": 1, "verify": self.verify_tokens}.get(kind, n),
            is_decode=decode,
            decode_order=g["decode_order"][:n] if decode else None,
        )

    def kind(self, step: StepInput) -> str:
        """The ladder a step replays from: decode steps and verify steps (a few tokens a sequence)
        by sequences, other steps with prompt tokens by tokens."""
        if step.is_decode:
            return "decode"
        verify = self.ladders["verify"]
        few = step.max_seqlen_q <= self.verify_tokens
        return "verify" if verify and few and len(step.context_lens) <= verify[-1] else "prompt"

    def units(self, step: StepInput, kind: str) -> int:
        """What the ladder `kind` counts of the step: its sequences, or its tokens."""
        return step.num_tokens if kind == "prompt" else len(step.context_lens)

    def can_replay(self, step: StepInput) -> bool:
        """Is there a graph for this step on its ladder?"""
        kind = self.kind(step)
        sizes = self.ladders[kind]
        return bool(self.graphs) and bool(sizes) and self.units(step, kind) <= sizes[-1]

    def write(self, step: StepInput) -> dict[str, torch.Tensor]:
        """The step's arrays into its ladder's graph inputs, in one copy (graph_inputs.py); the
        device views of its input_ids, sample_rows, carry_index and carry_rows."""
        kind, size = self.size(step)
        return self.inputs[kind].write(step, self.tokens(kind, size), self.seqs(kind, size))

    def size(self, step: StepInput) -> tuple[str, int]:
        """The step's ladder and the captured size it is padded up to."""
        kind = self.kind(step)
        return kind, graph_for(self.units(step, kind), self.ladders[kind])

    def replay(self, step: StepInput) -> torch.Tensor:
        """(tokens, hidden): the hidden states of the step `write` wrote."""
        key = self.size(step)
        self.graphs[key].replay()
        self.num_replays[key[0]] += 1
        return self.output[: step.num_tokens]
