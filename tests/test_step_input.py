"""The final engine's step inputs (engine/step_input.py): the arrays built from the scheduled
sequences, here the decode launch order, and the one buffer they reach the device in."""

import numpy as np
import torch

from nanovllm_final.engine.sequence import Sequence
from nanovllm_final.engine.step_input import build_step_input, pack, unpack
from nanovllm_final.sampling_params import SamplingParams

BLOCK = 4


def _seq(length: int, cached: int) -> Sequence:
    seq = Sequence(list(range(1, length + 1)), SamplingParams(max_tokens=8).resolve({}))
    seq.block_table = list(range(-(-length // BLOCK)))
    seq.num_cached_tokens, seq.num_scheduled_tokens = cached, length - cached
    return seq


def test_decode_order_is_longest_context_first():
    lengths = [5, 12, 3, 12, 9]
    step = build_step_input([_seq(n, n - 1) for n in lengths], BLOCK)
    assert step.is_decode
    assert step.context_lens.tolist() == lengths
    # decreasing context, ties in batch order: a permutation of the rows
    assert step.decode_order.tolist() == [1, 3, 4, 0, 2]


def test_a_prefill_step_has_its_order_too():
    """Every field is an array (the workers' message): a prefill step's order, unused, as well."""
    step = build_step_input([_seq(6, 0), _seq(3, 2)], BLOCK)
    assert not step.is_decode and step.decode_order.tolist() == [0, 1]


def _same(a, b) -> bool:
    return all(
        (getattr(a, f) == getattr(b, f)).all()
        if hasattr(getattr(a, f), "shape")
        else getattr(a, f) == getattr(b, f)
        for f in a.__dataclass_fields__
    )


def test_block_tables_kept_from_step_to_step_equal_fresh_ones():
    """The engine's BlockTables writes only the rows that grew when a step runs the sequences of
    the step before, and writes a new list whole: every step's arrays are those of a fresh build,
    also after the longest sequence grew (a wider array) and after the list changed."""
    from nanovllm_final.engine.step_input import BlockTables

    tables = BlockTables()
    seqs = [_seq(n, n - 1) for n in (5, 12, 3)]
    history = []
    for step in range(12):
        if step == 6:  # one ends, another joins: a new list
            seqs = seqs[1:] + [_seq(7, 6)]
        for seq in seqs:  # one more token each; a new block when the last one is full
            seq.token_ids.append(0)
            seq.num_cached_tokens = len(seq) - 1
            if len(seq.block_table) * BLOCK < len(seq):
                seq.block_table.append(100 + 10 * step + len(seq.block_table))
        got = build_step_input(seqs, BLOCK, None, tables)
        assert _same(got, build_step_input(seqs, BLOCK))
        history.append((got.block_tables, got.block_tables.copy()))
    assert history[0][0].shape[1] < history[5][0].shape[1]  # it widened
    assert all(
        (kept == at_the_time).all() for kept, at_the_time in history
    )  # later steps wrote elsewhere


def test_packed_arrays_come_back_with_their_dtypes_shapes_and_values():
    """upload's one copy: pack puts a step's arrays into one buffer, unpack views them again,
    each at an aligned offset (views of other dtypes need it), empty and strided ones included."""
    step = build_step_input([_seq(6, 0), _seq(3, 2), _seq(9, 4)], BLOCK)
    arrays = list(step.arrays().values()) + [
        np.zeros(0, np.int64),
        np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],
        np.array([True, False, True]),
        np.full((2, 3), 0.5, np.float32),
    ]
    assert {"input_ids", "positions", "block_tables", "carry_rows", "decode_order"} <= set(
        step.arrays()
    )
    packed, offsets = pack(arrays)
    assert all(start % 16 == 0 for start in offsets)
    for array, tensor in zip(arrays, unpack(packed, arrays, offsets)):
        assert (
            tensor.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
            and tuple(tensor.shape) == array.shape
        )
        assert np.array_equal(tensor.numpy(), array)


def test_decode_rows_known_and_pending():
    """A decode step's rows: a known token is fed by id, a pending one (sampled by the step in
    flight) is a 0 carried in on the device from that step's output row; the rows that sample are
    those Sequence.samples_this_step names."""
    known, pending = _seq(5, 4), _seq(7, 7)
    pending.num_pending, pending.num_scheduled_tokens = 1, 1  # its 8th token is still on the device
    pending.block_table = list(range(2))
    step = build_step_input([known, pending, _seq(3, 2)], BLOCK, pending_rows={pending.seq_id: 5})
    assert step.is_decode and step.input_ids.tolist() == [5, 0, 3]
    assert step.carry_index.tolist() == [1] and step.carry_rows.tolist() == [5]
    assert step.positions.tolist() == [4, 7, 2]
    assert step.sample_rows.tolist() == [
        i for i, s in enumerate([known, pending]) if s.samples_this_step
    ] + [2]
