"""A decode step's inputs where its CUDA graph reads them, sent in one copy.

The decode graphs read their inputs from views of one device block. The host writes a step's
arrays into a pinned copy of that block (numpy, no tensor op), pads the rows up to the graph's
size, and queues one copy of the block's used part: a step costs one host-to-device copy and one
copy on the device, instead of an upload, a view per array and a copy or fill per graph buffer.
The per-row arrays come first, each sized for the largest graph, then the step's block tables
packed (sequences x its widest table), so what a step uses is a prefix of the block; the copy on
the device spreads the packed tables into the graphs' (rows, max_blocks) table, whose width
max_model_len sets, and which is never sent whole. Three host copies take turns; each waits for
its last copy, three steps back, to have run (overlap scheduling keeps at most two steps in
flight, so it has)."""

import numpy as np
import torch

from .step_input import StepInput

ROW_ARRAYS = {  # name -> dtype of the per-row arrays, in block order
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "sample_rows": torch.int64,
    "carry_index": torch.int64,
    "carry_rows": torch.int64,
    "context_lens": torch.int32,
    "decode_order": torch.int32,
}
PADDING = {
    "input_ids": 0,
    "positions": 0,
    "slot_mapping": -1,
    "context_lens": 0,
}  # a padding row stores and attends to nothing
NUM_HOST_COPIES = 3


class DecodeInputs:
    def __init__(self, rows: int, max_blocks: int, device: torch.device):
        """rows: the largest decode graph's sequences; max_blocks: a block table's width."""
        self.rows, self.max_blocks = rows, max_blocks
        self.offsets, total = {}, 0
        for name, dtype in ROW_ARRAYS.items():
            self.offsets[name] = total
            total += rows * dtype.itemsize
        table_bytes = rows * max_blocks * torch.int32.itemsize
        self.offsets["packed_tables"] = (
            total  # the step's (seqs, width) tables, as the host sends them
        )
        self.offsets["block_tables"] = (
            total + table_bytes
        )  # (rows, max_blocks): what the graphs read; on the device only
        self.block = torch.zeros(total + 2 * table_bytes, dtype=torch.uint8, device=device)
        self.views = self._views(self.block)
        self.views["block_tables"].fill_(-1)
        pin = device.type == "cuda"
        self.host = [
            torch.zeros(total + table_bytes, dtype=torch.uint8, pin_memory=pin)
            for _ in range(NUM_HOST_COPIES)
        ]
        self.host_views = [
            {name: view.numpy() for name, view in self._views(h).items()} for h in self.host
        ]
        self.copied = [
            torch.cuda.Event() if pin else None for _ in self.host
        ]  # each host copy's last copy to the device
        self.turn = 0
        self.order_padding = np.arange(rows, dtype=np.int32)  # padding rows run last, each once

    def _views(self, block: torch.Tensor) -> dict[str, torch.Tensor]:
        """The arrays' views of `block` (the device's, or a host copy, which ends at block_tables)."""
        at = self.offsets
        views = {
            name: block[at[name] : at[name] + self.rows * dtype.itemsize].view(dtype)
            for name, dtype in ROW_ARRAYS.items()
        }
        views["packed_tables"] = block[at["packed_tables"] : at["block_tables"]].view(
            torch.int32
        )  # (rows * max_blocks,)
        if len(block) > at["block_tables"]:
            views["block_tables"] = (
                block[at["block_tables"] :].view(torch.int32).view(self.rows, self.max_blocks)
            )
        return views

    def write(self, step: StepInput, size: int) -> dict[str, torch.Tensor]:
        """Put the step's arrays in the first rows (rows n..size padding) and queue the copy to the
        device; returns the device views of the step's own rows: input_ids, sample_rows,
        carry_index and carry_rows."""
        i, self.turn = self.turn, (self.turn + 1) % NUM_HOST_COPIES
        if self.copied[i] is not None:
            self.copied[i].synchronize()  # its last copy has run: it may be written again
        h = self.host_views[i]
        n, k, rows = step.num_tokens, len(step.carry_index), len(step.sample_rows)
        for name, pad in PADDING.items():
            h[name][:n] = getattr(step, name)
            h[name][n:size] = pad
        h["decode_order"][:n] = step.decode_order
        h["decode_order"][n:size] = self.order_padding[n:size]
        h["sample_rows"][:rows] = step.sample_rows
        h["carry_index"][:k] = step.carry_index
        h["carry_rows"][:k] = step.carry_rows
        width = step.block_tables.shape[1]
        h["packed_tables"][: n * width] = step.block_tables.reshape(-1)
        end = self.offsets["packed_tables"] + n * width * torch.int32.itemsize
        self.block[:end].copy_(self.host[i][:end], non_blocking=True)
        if self.copied[i] is not None:
            self.copied[i].record()
        v = self.views
        # (seqs, width) into the graphs' table: its columns past width and its padding rows are never read
        v["block_tables"][:n, :width].copy_(v["packed_tables"][: n * width].view(n, width))
        return {
            "input_ids": v["input_ids"][:n],
            "sample_rows": v["sample_rows"][:rows],
            "carry_index": v["carry_index"][:k],
            "carry_rows": v["carry_rows"][:k],
        }
