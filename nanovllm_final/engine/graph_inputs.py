"""A step's inputs where its CUDA graph reads them, sent in one copy.

The graphs of one ladder (decode steps, or steps with prompt tokens) read their inputs from
views of one device block. The host writes a step's arrays into a pinned copy of that block
(numpy, no tensor op), pads the rows up to the graph's size, and queues one copy of the block's
used part: a step costs one host-to-device copy and one copy on the device, instead of an
upload, a view per array and a copy or fill per graph buffer (a dozen tensor ops on the host's
critical path, for the small steps that verify proposals as much as for decode steps).
The per-token arrays come first, each sized for the largest graph, then the per-sequence ones,
then the step's block tables packed (sequences x its widest table), so what a step uses is a
prefix of the block; the copy on the device spreads the packed tables into the graphs'
(rows, max_blocks) table, whose width max_model_len sets, and which is never sent whole. Three
host copies take turns; each waits for its last copy, three steps back, to have run (overlap
scheduling keeps at most two steps in flight, so it has).

A padding row stores nothing (slot -1); a padding sequence attends to nothing (context 0) and,
in a step with prompts, holds no token (its cu_seqlens_q entries repeat the step's token count);
in a decode step the padding rows run last (decode_order)."""

import numpy as np
import torch

from .step_input import StepInput, aligned

TOKEN_ARRAYS = {  # name -> dtype of the per-token arrays, in block order
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "sample_rows": torch.int64,
    "carry_index": torch.int64,
    "carry_rows": torch.int64,
}
SEQ_ARRAYS = {  # per sequence: decode steps read decode_order, steps with prompts cu_seqlens_q
    True: {"context_lens": torch.int32, "decode_order": torch.int32},
    False: {"context_lens": torch.int32, "cu_seqlens_q": torch.int32},
}
PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1}  # a padding row stores nothing
NUM_HOST_COPIES = 3


class GraphInputs:
    def __init__(
        self, token_rows: int, seq_rows: int, max_blocks: int, device: torch.device, decode: bool
    ):
        """token_rows, seq_rows: the largest graph's tokens and sequences (equal for decode);
        max_blocks: a block table's width; decode: the decode ladder's (else the prompt one's)."""
        self.seq_rows, self.max_blocks, self.decode = seq_rows, max_blocks, decode
        self.sizes = {name: token_rows for name in TOKEN_ARRAYS}  # elements of each array
        self.sizes |= {name: seq_rows for name in SEQ_ARRAYS[decode]}
        if not decode:
            self.sizes["cu_seqlens_q"] = seq_rows + 1
        self.dtypes = TOKEN_ARRAYS | SEQ_ARRAYS[decode]
        # every view starts at a multiple of ALIGN, as an upload's arrays do, so that Triton
        # specializes a captured step's kernels as it does an eager step's
        self.offsets, total = {}, 0
        for name, dtype in self.dtypes.items():
            self.offsets[name] = total
            total += aligned(self.sizes[name] * dtype.itemsize)
        table_bytes = aligned(seq_rows * max_blocks * torch.int32.itemsize)
        self.offsets["packed_tables"] = (
            total  # the step's (seqs, width) tables, as the host sends them
        )
        self.offsets["block_tables"] = (
            total + table_bytes
        )  # (seq_rows, max_blocks): what the graphs read; on the device only
        self.block = torch.zeros(total + 2 * table_bytes, dtype=torch.uint8, device=device)
        self.views = self._views(self.block, on_device=True)
        self.views["block_tables"].fill_(-1)
        self.views["slot_mapping"].fill_(-1)  # capturing stores nothing
        pin = device.type == "cuda"
        self.host = [
            torch.zeros(total + table_bytes, dtype=torch.uint8, pin_memory=pin)
            for _ in range(NUM_HOST_COPIES)
        ]
        self.host_views = [
            {name: view.numpy() for name, view in self._views(h, on_device=False).items()}
            for h in self.host
        ]
        self.copied = [
            torch.cuda.Event() if pin else None for _ in self.host
        ]  # each host copy's last copy to the device
        self.turn = 0
        self.order_padding = np.arange(seq_rows, dtype=np.int32)  # padding rows run last, each once

    def _views(self, block: torch.Tensor, on_device: bool) -> dict[str, torch.Tensor]:
        """The arrays' views of `block` (the device's, or a host copy, which ends at block_tables)."""
        at = self.offsets
        views = {
            name: block[at[name] : at[name] + self.sizes[name] * dtype.itemsize].view(dtype)
            for name, dtype in self.dtypes.items()
        }
        table = self.seq_rows * self.max_blocks * torch.int32.itemsize
        views["packed_tables"] = block[at["packed_tables"] : at["packed_tables"] + table].view(
            torch.int32
        )  # (seq_rows * max_blocks,)
        if on_device:
            views["block_tables"] = (
                block[at["block_tables"] : at["block_tables"] + table]
                .view(torch.int32)
                .view(self.seq_rows, self.max_blocks)
            )
        return views

    def write(self, step: StepInput, size: int, rows: int) -> dict[str, torch.Tensor]:
        """Put the step's arrays in the first rows of a graph of `size` tokens and `rows`
        sequences (the rest padding) and queue the copy to the device; returns the device views
        of the step's own rows: input_ids, sample_rows, carry_index and carry_rows."""
        i, self.turn = self.turn, (self.turn + 1) % NUM_HOST_COPIES
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # its last copy has run: it may be written again
        h = self.host_views[i]
        n, seqs = step.num_tokens, len(step.context_lens)
        k, sampled = len(step.carry_index), len(step.sample_rows)
        for name, pad in PADDING.items():
            h[name][:n] = getattr(step, name)
            h[name][n:size] = pad
        h["context_lens"][:seqs] = step.context_lens
        h["context_lens"][seqs:rows] = 0
        if self.decode:
            h["decode_order"][:seqs] = step.decode_order
            h["decode_order"][seqs:rows] = self.order_padding[seqs:rows]
        else:
            h["cu_seqlens_q"][: seqs + 1] = step.cu_seqlens_q
            h["cu_seqlens_q"][seqs + 1 : rows + 1] = n
        h["sample_rows"][:sampled] = step.sample_rows
        h["carry_index"][:k] = step.carry_index
        h["carry_rows"][:k] = step.carry_rows
        width = step.block_tables.shape[1]
        h["packed_tables"][: seqs * width] = step.block_tables.reshape(-1)
        end = self.offsets["packed_tables"] + seqs * width * torch.int32.itemsize
        self.block[:end].copy_(self.host[i][:end], non_blocking=True)
        if self.copied[i] is not None:
            self.copied[i].record()
        v = self.views
        # (seqs, width) into the graphs' table: its columns past width and its padding rows are never read
        v["block_tables"][:seqs, :width].copy_(v["packed_tables"][: seqs * width].view(seqs, width))
        return {
            "input_ids": v["input_ids"][:n],
            "sample_rows": v["sample_rows"][:sampled],
            "carry_index": v["carry_index"][:k],
            "carry_rows": v["carry_rows"][:k],
        }
