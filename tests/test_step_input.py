"""The final engine's step inputs (engine/step_input.py): the arrays built from the scheduled
sequences, here the decode launch order."""

from nanovllm_final.engine.sequence import Sequence
from nanovllm_final.engine.step_input import build_step_input
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
