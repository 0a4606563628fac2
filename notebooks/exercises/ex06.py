"""Checks for 06_cudagraph.ipynb: the ladder of captured batch sizes, and padding a decode
batch up to the graph that replays it."""

from types import SimpleNamespace

import torch

from . import stage
from .report import expect_close, expect_equal, fail

STAGE = "06_cudagraph"


def check_graph_batch_sizes(graph_batch_sizes) -> str:
    """graph_batch_sizes(max_num_seqs) -> the sizes to capture, ascending. Compared with the stage's
    graph_batch_sizes for every max_num_seqs from 1 to 1100."""
    expected_fn = stage.module(STAGE, "engine.model_runner").graph_batch_sizes
    for max_num_seqs in range(1, 1101):
        expect_equal(graph_batch_sizes(max_num_seqs), expected_fn(max_num_seqs),
                     "the ladder differs from the stage's (1, 2, 4, 8, then multiples of 16, and max_num_seqs "
                     "itself; never above 512)", max_num_seqs=max_num_seqs)
    return "the same ladder as the stage for every max_num_seqs from 1 to 1100"


class _Graph:
    """Stands in for a captured CUDA graph: replay() only notes that it was called."""

    def __init__(self, size, replayed):
        self.size, self.replayed = size, replayed

    def replay(self):
        self.replayed.append(self.size)


def stage_replay(slot_mapping: list[int], context_lens: list[int], sizes: list[int]) -> tuple[int, list[int], list[int]]:
    """Run the stage's ModelRunner.replay on stand-in graphs: the size it replays and the slot
    mapping and context lengths it leaves in the graph's first rows (buffers start as garbage)."""
    runner_module = stage.module(STAGE, "engine.model_runner")
    Context = stage.module(STAGE, "layers.context").Context
    n, max_bs, replayed = len(slot_mapping), sizes[-1], []
    runner = SimpleNamespace(
        graph_sizes=sizes, num_graph_replays=0,
        graphs={bs: _Graph(bs, replayed) for bs in sizes},
        graph_inputs={  # what capture allocates, filled with garbage: a replay must set every row it uses
            "input_ids": torch.full((max_bs,), 777), "positions": torch.full((max_bs,), 777),
            "slot_mapping": torch.full((max_bs,), 777), "context_lens": torch.full((max_bs,), 777, dtype=torch.int32),
            "block_tables": torch.full((max_bs, 4), 777, dtype=torch.int32),
        },
        graph_output=torch.zeros(max_bs, 1),
    )
    context = Context(cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), slot_mapping=torch.tensor(slot_mapping),
                      context_lens=torch.tensor(context_lens, dtype=torch.int32),
                      block_tables=torch.zeros(n, 4, dtype=torch.int32), max_seqlen_q=1, is_decode=True)
    runner_module.ModelRunner.replay(runner, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), context)
    (bs,) = replayed
    g = runner.graph_inputs
    return bs, g["slot_mapping"][:bs].tolist(), g["context_lens"][:bs].tolist()


PAD_CASES = [  # (slot mapping, context lengths, captured sizes)
    ([13, 40, 7], [14, 41, 8], [1, 2, 4, 8]),
    ([5], [6], [1, 2, 4, 8]),
    ([3, 9, 21, 30, 2], [4, 10, 22, 31, 3], [1, 2, 4, 6]),
    ([11, 12, 13, 14], [2, 3, 4, 5], [1, 2, 4, 8, 16]),
    (list(range(100, 117)), list(range(1, 18)), [1, 2, 4, 8, 16, 32]),
]


def check_pad_for_graph(pad_for_graph) -> str:
    """pad_for_graph(slot_mapping, context_lens, sizes) -> (bs, slots, lens): the captured size
    that replays a decode step of len(slot_mapping) sequences, and its inputs padded to bs rows.
    Compared with what the stage's ModelRunner.replay writes into the graph's buffers."""
    for slots, lens, sizes in PAD_CASES:
        bs, expected_slots, expected_lens = stage_replay(slots, lens, sizes)
        got = pad_for_graph(list(slots), list(lens), list(sizes))
        inputs = dict(slot_mapping=slots, context_lens=lens, sizes=sizes)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            fail("return three things: (bs, padded slot mapping, padded context lengths)", got=got)
        expect_equal(got[0], bs, "the wrong graph: a batch replays the smallest captured size that holds it", **inputs)
        expect_equal(got[1], expected_slots, "the padded slot mapping differs from the stage's (padding rows must "
                     "store nothing: slot -1)", **inputs)
        expect_equal(got[2], expected_lens, "the padded context lengths differ from the stage's (padding rows "
                     "must attend to nothing: length 0)", **inputs)
    return f"the same graph size and padded inputs as the stage's replay in {len(PAD_CASES)} decode steps"


def stand_in_runner(max_bs: int, width: int, hidden: int, replayed: list):
    """A runner as capture leaves it, with stand-in graphs (replay() notes its size and writes a
    recognisable output: row i = the input id of row i, plus 1000 times the graph's size) and
    every buffer full of garbage."""
    graphs = {}
    runner = SimpleNamespace(graph_sizes=[], num_graph_replays=0, graphs=graphs, graph_output=torch.zeros(max_bs, hidden),
                             graph_inputs={"input_ids": torch.full((max_bs,), 777), "positions": torch.full((max_bs,), 777),
                                           "slot_mapping": torch.full((max_bs,), 777),
                                           "context_lens": torch.full((max_bs,), 777, dtype=torch.int32),
                                           "block_tables": torch.full((max_bs, width), 777, dtype=torch.int32)})

    class Graph:
        def __init__(self, size):
            self.size = size

        def replay(self):
            replayed.append(self.size)
            ids = runner.graph_inputs["input_ids"][: self.size].float()
            runner.graph_output[: self.size] = (ids + 1000 * self.size).unsqueeze(1)  # (size, hidden)

    return runner, Graph


REPLAY_CASES = [  # (sizes, decode batch size, block-table width of the step)
    ([1, 2, 4, 8], 3, 2), ([1, 2, 4, 8], 8, 4), ([1, 2, 4, 8, 16], 5, 3), ([1, 2, 4, 6], 1, 1), ([1, 2, 4, 8, 16, 32], 17, 4),
]


def check_replay(replay) -> str:
    """STRETCH. replay(self, input_ids, positions, context) -> (n, hidden): the stage's
    ModelRunner.replay, written again and run on a stand-in runner whose graphs note their size
    and whose buffers start full of garbage. Copy the step's inputs into the static buffers
    (input ids, positions, slot mapping, context lengths, block tables), pad the batch to the
    next captured size (slot -1, context 0), replay that graph, count it, and return the first n
    rows of the output. Compared with the stage's own replay on the same stand-in."""
    runner_module = stage.module(STAGE, "engine.model_runner")
    Context = stage.module(STAGE, "layers.context").Context
    g = torch.Generator().manual_seed(15)
    for sizes, n, width in REPLAY_CASES:
        ids, positions = torch.randint(3, 500, (n,), generator=g), torch.randint(0, 60, (n,), generator=g)
        context = Context(cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), slot_mapping=torch.randint(0, 90, (n,), generator=g),
                          context_lens=(positions + 1).to(torch.int32), max_seqlen_q=1, is_decode=True,
                          block_tables=torch.randint(0, 12, (n, width), generator=g, dtype=torch.int32))
        results = []
        for fn in (runner_module.ModelRunner.replay, replay):
            replayed = []
            runner, Graph = stand_in_runner(max(sizes), 6, 2, replayed)
            runner.graph_sizes, runner.graphs = list(sizes), {bs: Graph(bs) for bs in sizes}
            out = fn(runner, ids.clone(), positions.clone(), context)
            results.append((runner, replayed, out))
        (ref, ref_replayed, ref_out), (mine, replayed, out) = results
        inputs = dict(sizes=sizes, n=n, block_table_width=width)
        expect_equal(replayed, ref_replayed, "the wrong graphs were replayed (one replay, of the smallest captured size "
                     "that holds the batch)", **inputs)
        bs = ref_replayed[0]
        for name, buffer in ref.graph_inputs.items():
            expect_equal(mine.graph_inputs[name][:bs], buffer[:bs], f"graph_inputs['{name}'] differs from the stage's "
                         f"in the {bs} rows the graph reads (padding rows: slot -1, context length 0)", **inputs)
        expect_equal(mine.num_graph_replays, ref.num_graph_replays, "count the replay (num_graph_replays)", **inputs)
        expect_close(out, ref_out, "return the graph's output for the n real rows", atol=0.0, **inputs)
    return f"the same buffers, graph, count and output as the stage's replay in {len(REPLAY_CASES)} decode steps"
