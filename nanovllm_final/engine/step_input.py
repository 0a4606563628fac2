"""One step's model inputs: plain arrays, built on rank 0 from the scheduled sequences and
sent as they are to every tensor-parallel rank (no Sequence ever crosses a process)."""

import functools
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np
import torch

from .prompt_scoring import PromptScoring, plan_scoring
from .sequence import Sequence


@dataclass
class StepInput:
    input_ids: np.ndarray  # (tokens,) int64: the fed tokens of every sequence, packed
    positions: np.ndarray  # (tokens,) int64
    slot_mapping: np.ndarray  # (tokens,) int64: cache slot of each fed token
    cu_seqlens_q: np.ndarray  # (seqs+1,) int32: where each sequence's tokens start
    context_lens: np.ndarray  # (seqs,) int32: cached tokens after this step's writes
    block_tables: np.ndarray  # (seqs, max_blocks) int32, padded with -1
    sample_rows: (
        np.ndarray
    )  # (rows,) int64: index of the last fed token of each sequence that samples
    # tokens sampled by the step before, still on the device (overlap scheduling): the runner
    # puts that step's sampled ids of rows carry_rows into input_ids at carry_index
    carry_index: np.ndarray  # (carried,) int64
    carry_rows: np.ndarray  # (carried,) int64
    max_seqlen_q: int
    is_decode: (
        bool  # every sequence feeds exactly one token: the decode kernels (and CUDA graphs) run
    )
    # the sequences by decreasing context length: the order the decode kernel starts them in
    decode_order: np.ndarray  # (seqs,) int32
    scoring: PromptScoring | None = (
        None  # the rows whose next prompt token is scored (prompt_logprobs)
    )
    num_proposed: int = 0  # proposals fed (speculative decoding): each samples a row of its own

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every array field by name: what the runner puts on the device (in one upload)."""
        return {name: value for name, value in vars(self).items() if isinstance(value, np.ndarray)}


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """On the device, copied from pinned memory so that the host does not wait for the copy
    (nor for the steps queued before it)."""
    return upload([array], device)[0]


ALIGN = 16  # bytes: every packed array starts at a multiple of any dtype's size (and Triton
# specializes a kernel on pointers divisible by 16: graph_inputs.py aligns its views alike)


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays on the device (as they are on a CPU one), in one copy: packed into one
    pinned host buffer, whose copy is queued without the host waiting for it (nor for the
    steps queued before it), and viewed on the device with each array's dtype and shape. The
    caching host allocator hands the buffer out again only once its copy has run."""
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    host, offsets = pack(arrays, pin=True)
    return unpack(host.to(device, non_blocking=True), arrays, offsets)


def pack(arrays: list[np.ndarray], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(bytes, offsets): the arrays' bytes in one uint8 tensor, each at an aligned offset."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += aligned(a.nbytes)
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=pin)
    buffer = host.numpy()
    for a, start in zip(arrays, offsets):
        buffer[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return host, offsets


def unpack(
    packed: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]
) -> list[torch.Tensor]:
    """Views of `packed` (pack's bytes, wherever they are) with the arrays' dtypes and shapes:
    the buffer is viewed once per dtype (its size and every offset are multiples of ALIGN),
    then sliced per array, as few tensor ops as there can be (a step runs this on the host's
    critical path)."""
    typed: dict[np.dtype, torch.Tensor] = {}
    views = []
    for a, start in zip(arrays, offsets):
        if a.dtype not in typed:
            typed[a.dtype] = packed.view(_torch_dtype(a.dtype))
        first = start // a.itemsize
        flat = typed[a.dtype][first : first + a.size]
        views.append(flat if a.ndim == 1 else flat.view(a.shape))
    return views


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def fed_ids(seq: Sequence, start: int, end: int):
    """The ids of the tokens fed from `start` to `end`: known ones, then proposals (speculative
    decoding); a pending one (it is always the last) is a placeholder 0 here, replaced on the
    device (carry_index)."""
    spec = seq.spec_token_ids[: max(0, end - seq.num_known_tokens)]
    return chain(seq.token_ids[start:end], spec, repeat(0, end - seq.num_known_tokens - len(spec)))


class BlockTables:
    """The steps' (seqs, max_blocks) block-table arrays, each built from the one before: a
    step that runs the same sequences as the step before (most decode steps) writes only the
    rows of the sequences that got a block since. While a sequence runs its block table only
    grows; a preempted or finished one leaves the list, and a new list is written whole."""

    def __init__(self):
        self.seq_ids: list[int] = []
        self.lens = np.zeros(0, np.int64)  # (seqs,) each row's blocks
        self.array = np.zeros((0, 0), np.int32)  # (seqs, width), padded with -1

    def build(self, seqs: list[Sequence]) -> np.ndarray:
        seq_ids = [s.seq_id for s in seqs]
        lens = np.fromiter((len(s.block_table) for s in seqs), np.int64, len(seqs))  # (seqs,)
        width = int(lens.max())
        if seq_ids != self.seq_ids or (lens < self.lens).any():
            self.array = np.full((len(seqs), width), -1, np.int32)
            old, rows = np.zeros_like(lens), range(len(seqs))
        else:
            if width > self.array.shape[1]:  # wider, padded with -1 (np.pad costs 10x as much)
                wider = np.full((len(seqs), width), -1, np.int32)
                wider[:, : self.array.shape[1]] = self.array
                self.array = wider
            old, rows = self.lens, np.flatnonzero(lens > self.lens).tolist()
        self.seq_ids = []  # until every row is written: a build that raised leaves the next one to start over
        for i in rows:
            self.array[i, old[i] : lens[i]] = seqs[i].block_table[old[i] : lens[i]]
        self.seq_ids, self.lens = seq_ids, lens
        return self.array.copy()  # the step's own: the next step writes into self.array


def build_step_input(
    seqs: list[Sequence],
    block_size: int,
    pending_rows: dict[int, int] | None = None,
    block_tables: BlockTables | None = None,
) -> StepInput:
    """Each sequence feeds `num_scheduled_tokens` tokens from `num_cached_tokens` on; the
    per-token arrays are computed with numpy, not a Python loop over tokens. `pending_rows`:
    the step in flight's output row of each sequence it samples for (seq_id -> row).
    `block_tables`: the engine's, kept from step to step (a fresh one when None)."""
    starts, counts, known, pending, proposed = _counters(seqs)
    ends = starts + counts
    cu = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(counts, out=cu[1:])
    seq_of_token = np.repeat(np.arange(len(seqs)), counts)  # (tokens,)
    positions = np.arange(cu[-1]) - cu[seq_of_token] + starts[seq_of_token]  # (tokens,)
    # (seqs, max_blocks)
    tables = (block_tables if block_tables is not None else BlockTables()).build(seqs)
    slots = (
        tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    max_seqlen_q = int(counts.max())
    is_decode = max_seqlen_q == 1
    input_ids = _input_ids(seqs, starts, ends, known, cu, is_decode)
    # (seqs,) the feed reaches the end: Sequence.samples_this_step
    samples = ends == known + pending + proposed
    carried = np.flatnonzero(pending)  # (carried,) rows whose fed token is a pending one
    return StepInput(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu.astype(np.int32),
        context_lens=ends.astype(np.int32),
        block_tables=tables,
        sample_rows=sample_rows(cu, samples, proposed, seq_of_token),
        carry_index=cu[1:][carried] - 1,
        carry_rows=np.fromiter(
            (pending_rows[seqs[i].seq_id] for i in carried.tolist()), np.int64, len(carried)
        ),
        max_seqlen_q=max_seqlen_q,
        is_decode=is_decode,
        decode_order=np.argsort(-ends, kind="stable").astype(np.int32),
        scoring=plan_scoring(seqs, starts, ends, cu),
        num_proposed=int(proposed.sum()),
    )


def _counters(seqs: list[Sequence]) -> tuple[np.ndarray, ...]:
    """(starts, counts, known, pending, proposed), each (seqs,) int64: the sequences' counters as
    arrays, one plain attribute per pass (a decode step has hundreds of rows)."""
    n = len(seqs)
    starts = np.fromiter((s.num_cached_tokens for s in seqs), np.int64, n)
    counts = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int64, n)
    known = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)  # ids the host knows
    pending = np.fromiter((s.num_pending for s in seqs), np.int64, n)  # sampled, on the device
    proposed = np.fromiter((len(s.spec_token_ids) for s in seqs), np.int64, n)  # speculative
    return starts, counts, known, pending, proposed


def _input_ids(
    seqs: list[Sequence],
    starts: np.ndarray,
    ends: np.ndarray,
    known: np.ndarray,
    cu: np.ndarray,
    is_decode: bool,
) -> np.ndarray:
    """(tokens,) int64: the fed tokens of every sequence, packed."""
    # decode: one token each, the one at `start`; a pending one (most, with overlap) is 0 here
    if is_decode:
        input_ids = np.zeros(len(seqs), np.int64)
        for i in np.flatnonzero(starts < known).tolist():
            input_ids[i] = seqs[i].token_ids[starts[i]]
        return input_ids
    return np.fromiter(
        chain.from_iterable(
            fed_ids(s, a, b) for s, a, b in zip(seqs, starts.tolist(), ends.tolist())
        ),
        np.int64,
        int(cu[-1]),
    )


def sample_rows(
    cu: np.ndarray, samples: np.ndarray, proposed: np.ndarray, seq_of_token: np.ndarray
) -> np.ndarray:
    """(rows,) the last fed token of each sequence that samples; a sequence verifying k proposals
    samples its last 1 + k rows. `seq_of_token` (tokens,): each fed token's sequence."""
    if not proposed.any():
        return (cu[1:] - 1)[samples]
    first = cu[1:] - np.where(samples, 1 + proposed, 0)  # (seqs,) the first row each samples
    return np.flatnonzero(np.arange(cu[-1]) >= first[seq_of_token])
