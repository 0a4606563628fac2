"""The final engine's CUDA-graph buffers (engine/cuda_graphs.py) on a CPU: the ladders, and a
replay through the padded static buffers against the same step run eagerly.

A CUDA graph replays exactly the launches it recorded on the buffers it recorded them on,
so a stand-in that runs the model again on those buffers' captured views checks everything
but the capture itself: how a step's inputs are padded into the buffers, and that the
Triton attention kernels (under the interpreter here) ignore the padding rows. The capture
itself is checked on a GPU (tests/test_gpu.py)."""

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
from nanovllm_final.engine.cuda_graphs import CUDAGraphs, graph_for, graph_token_sizes  # noqa: E402
from nanovllm_final.engine.sequence import Sequence  # noqa: E402
from nanovllm_final.engine.step_input import build_step_input  # noqa: E402
from nanovllm_final.kernels import attention as attention_triton  # noqa: E402
from nanovllm_final.layers.attention import Attention  # noqa: E402
from nanovllm_final.layers.context import Context, set_context  # noqa: E402
from nanovllm_final.layers.rotary import RotaryEmbedding  # noqa: E402
from nanovllm_final.sampling_params import SamplingParams  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, VOCAB = 4, 2, 16, 4, 97
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_token_ladder():
    assert graph_token_sizes(16384)[:8] == [16, 24, 32, 48, 64, 96, 128, 192]
    assert graph_token_sizes(8192)[-3:] == [4096, 6144, 8192]
    assert graph_token_sizes(100) == [16, 24, 32, 48, 64, 96, 100]
    assert graph_token_sizes(10) == [10] and graph_token_sizes(0) == []
    sizes = graph_token_sizes(1000)
    assert [graph_for(n, sizes) for n in (1, 16, 17, 25, 700, 1000)] == [16, 16, 24, 32, 768, 1000]
    # padding adds at most half of the step
    assert all(graph_for(n, sizes) <= max(16, 1.5 * n) for n in range(1, 1001))


class AttentionOnly(nn.Module):
    """Token ids -> q, k, v (an embedding) -> RoPE and paged attention -> (tokens, heads * head_dim)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Embedding(VOCAB, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
        self.attn.backend = attention_triton
        self.rotary = RotaryEmbedding(HEAD_DIM, 512, 10000.0, None)

    def forward(self, input_ids, positions):
        qkv = (
            self.qkv(input_ids) + positions[:, None] * 1e-2
        )  # (tokens, (heads + 2 kv_heads) * head_dim)
        q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        n = len(input_ids)
        q, k, v = (
            q.view(n, HEADS, HEAD_DIM),
            k.view(n, KV_HEADS, HEAD_DIM),
            v.reshape(n, KV_HEADS, HEAD_DIM),
        )
        return self.attn(positions, q, k, v, self.rotary).flatten(1)


class Recorded:
    """Stands in for a captured graph: replay() runs the model on the buffer views of the key."""

    def __init__(self, graphs: CUDAGraphs, model: nn.Module, key: tuple[str, int]):
        self.graphs, self.model, self.key = graphs, model, key

    def replay(self) -> None:
        n = self.graphs.tokens(*self.key)
        set_context(self.graphs.context(*self.key))
        ids, pos = self.graphs.token_inputs(self.key[0])
        self.graphs.output[:n] = self.model(ids[:n], pos[:n])
        set_context(None)


def recorded(graphs: CUDAGraphs, model: nn.Module) -> dict:
    """A stand-in for every graph of every ladder."""
    return {
        (kind, size): Recorded(graphs, model, (kind, size))
        for kind, sizes in graphs.ladders.items()
        for size in sizes
    }


def _seq(length: int, cached: int, first_block: int) -> Sequence:
    seq = Sequence(
        [(7 * i + length) % VOCAB for i in range(length)], SamplingParams(max_tokens=4).resolve({})
    )
    seq.block_table = list(range(first_block, first_block + -(-length // BLOCK)))
    seq.num_cached_tokens, seq.num_scheduled_tokens = cached, length - cached
    return seq


def _tensor(array) -> torch.Tensor:
    return torch.from_numpy(array).to(DEVICE)


def _context(step) -> Context:
    t = {
        name: _tensor(getattr(step, name))
        for name in ("cu_seqlens_q", "slot_mapping", "context_lens", "block_tables", "decode_order")
    }
    return Context(
        t["cu_seqlens_q"],
        t["slot_mapping"],
        t["context_lens"],
        t["block_tables"],
        step.max_seqlen_q,
        step.is_decode,
        t["decode_order"] if step.is_decode else None,
    )


# (length, cached) per sequence: a step with prompts (decodes, a chunk after a cached prefix,
# a whole new prompt of more than two query tiles), a decode step, and a verify step (at most
# VERIFY tokens a sequence)
STEPS = {
    "prompt": [(9, 8), (13, 5), (140, 0), (6, 5)],
    "decode": [(9, 8), (30, 29), (5, 4)],
    "verify": [(9, 6), (30, 29), (5, 3)],
}
EXTRA = {
    "prompt": (12, 0),
    "decode": (12, 11),
    "verify": (12, 9),
}  # one more sequence: the same graph, a larger step
VERIFY = 3  # 1 + k


def _steps(kind: str):
    """The step, a larger one of the same graph before it (it leaves its rows in the buffers), blocks used."""
    seqs, first = [], 0
    for length, cached in [*STEPS[kind], EXTRA[kind]]:
        seqs.append(_seq(length, cached, first))
        first += len(seqs[-1].block_table)
    return build_step_input(seqs[:-1], BLOCK), build_step_input(seqs, BLOCK), first


@pytest.mark.parametrize("kind", list(STEPS))
@torch.inference_mode()
def test_replay_through_padded_buffers_matches_eager(kind):
    """Replayed after a larger step of the same graph, whose rows the smaller one must pad away."""
    torch.manual_seed(0)
    model = AttentionOnly().to(DEVICE)
    graphs = CUDAGraphs(
        max_num_seqs=8,
        max_prompt_tokens=256,
        max_model_len=256,
        block_size=BLOCK,
        hidden_size=HEADS * HEAD_DIM,
        dtype=torch.float32,
        device=DEVICE,
        verify_tokens=VERIFY,
        max_step_tokens=256,
    )
    graphs.graphs = recorded(graphs, model)
    step, larger, num_blocks = _steps(kind)
    assert step.is_decode == larger.is_decode == (kind == "decode")
    assert graphs.kind(step) == graphs.kind(larger) == kind
    assert graphs.size(step) == graphs.size(larger)
    cache = torch.randn(
        2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=DEVICE
    )  # the cached prefixes (and stale slots)
    outputs, caches = [], []

    def replay(step):  # written into its ladder's graph inputs in one copy, then replayed
        assert graphs.can_replay(step)
        t = graphs.write(step)
        assert torch.equal(t["input_ids"].cpu(), torch.from_numpy(step.input_ids))
        assert t["sample_rows"].tolist() == step.sample_rows.tolist()
        return graphs.replay(step)

    for replayed in (False, True):
        if replayed:
            model.attn.k_cache, model.attn.v_cache = cache.clone().unbind(0)
            replay(larger)
        model.attn.k_cache, model.attn.v_cache = kv = cache.clone().unbind(0)
        ids, pos, context = _tensor(step.input_ids), _tensor(step.positions), _context(step)
        if replayed:
            out = replay(step).clone()
        else:
            set_context(context)
            out = model(ids, pos)
            set_context(None)
        outputs.append(out)
        caches.append(torch.stack(kv))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[1], caches[0])  # the padding rows stored nothing
    assert graphs.num_replays[kind] == 2


def test_verify_ladder():
    """Verify steps' graphs: the decode ladder's sizes whose 1 + k tokens a sequence fit in a step;
    none without speculation."""
    options = dict(max_prompt_tokens=64, max_model_len=64, block_size=BLOCK, hidden_size=8)
    options |= dict(dtype=torch.float32, device=DEVICE)
    graphs = CUDAGraphs(max_num_seqs=40, verify_tokens=5, max_step_tokens=100, **options)
    assert graphs.ladders["verify"] == [1, 2, 4, 8, 16] and graphs.tokens("verify", 16) == 80
    assert graphs.ladders["decode"] == [1, 2, 4, 8, 16, 32, 40]
    for spec in ({}, dict(verify_tokens=0, max_step_tokens=100)):
        assert CUDAGraphs(max_num_seqs=40, **spec, **options).ladders["verify"] == []


def test_larger_steps_run_eagerly():
    graphs = CUDAGraphs(
        max_num_seqs=4,
        max_prompt_tokens=32,
        max_model_len=64,
        block_size=BLOCK,
        hidden_size=8,
        dtype=torch.float32,
        device=DEVICE,
    )
    graphs.graphs = {("prompt", 32): None}
    step = build_step_input([_seq(33, 0, 0)], BLOCK)
    assert not graphs.can_replay(step)
    step = build_step_input([_seq(32, 0, 0)], BLOCK)
    assert graphs.can_replay(step)
    step = build_step_input([_seq(9, 8, 0) for _ in range(5)], BLOCK)
    assert step.is_decode and not graphs.can_replay(step)  # 5 sequences: past the decode ladder


def test_decode_inputs_rows_padding_and_tables():
    """GraphInputs.write puts a step's arrays where the decode graphs read them, after a wider step
    of the same graph size: its rows, padding rows up to the graph's size that store and attend to
    nothing and run last, and its packed block tables spread into the graphs' (rows, max_blocks) table."""
    from nanovllm_final.engine.graph_inputs import GraphInputs

    inputs = GraphInputs(8, 8, max_blocks=6, device=DEVICE, decode=True)
    wider = build_step_input(
        [_seq(20, 19, 0), _seq(9, 8, 5), _seq(13, 12, 8), _seq(5, 4, 12)], BLOCK
    )
    inputs.write(wider, 4, 4)
    chunk = _seq(
        9, 4, 3
    )  # a prompt fed one token short of its end: a decode-shaped step's row that samples nothing
    chunk.num_scheduled_tokens = 1
    step = build_step_input([_seq(9, 8, 0), chunk, _seq(5, 4, 6)], BLOCK)
    assert step.is_decode and step.sample_rows.tolist() == [0, 2]
    t = inputs.write(step, 4, 4)
    v = {name: view.cpu() for name, view in inputs.views.items()}
    assert (
        torch.equal(t["input_ids"].cpu(), torch.from_numpy(step.input_ids))
        and len(t["carry_index"]) == 0
    )
    assert t["sample_rows"].tolist() == [0, 2]
    for name in ("positions", "slot_mapping", "context_lens", "decode_order"):
        assert v[name][:3].tolist() == getattr(step, name).tolist(), name
    assert v["slot_mapping"][3:4].tolist() == [-1] and v["context_lens"][3:4].tolist() == [0]
    assert v["decode_order"][3:4].tolist() == [3]
    width = step.block_tables.shape[1]
    assert width < wider.block_tables.shape[1]
    assert v["block_tables"][:3, :width].tolist() == step.block_tables.tolist()


def test_prompt_inputs_rows_padding_and_tables():
    """GraphInputs.write for a step with prompt tokens, after a larger step of the same graph: the
    tokens' rows and padding rows that store nothing, the sequences' context lengths and token
    ranges with padding sequences that attend to nothing and hold no token, the packed tables."""
    from nanovllm_final.engine.graph_inputs import GraphInputs

    inputs = GraphInputs(32, 8, max_blocks=12, device=DEVICE, decode=False)
    larger = build_step_input([_seq(20, 0, 0), _seq(9, 8, 5), _seq(6, 2, 8), _seq(3, 2, 10)], BLOCK)
    inputs.write(larger, 32, 8)
    step = build_step_input([_seq(9, 8, 0), _seq(14, 3, 3)], BLOCK)
    assert not step.is_decode and step.num_tokens == 12
    t = inputs.write(step, 16, 8)
    v = {name: view.cpu() for name, view in inputs.views.items()}
    assert t["input_ids"].tolist() == step.input_ids.tolist()
    assert t["sample_rows"].tolist() == step.sample_rows.tolist() == [0, 11]
    for name in ("input_ids", "positions", "slot_mapping"):
        assert v[name][:12].tolist() == getattr(step, name).tolist(), name
    assert v["slot_mapping"][12:16].tolist() == [-1] * 4
    assert v["context_lens"][:8].tolist() == step.context_lens.tolist() + [0] * 6
    assert v["cu_seqlens_q"][:9].tolist() == step.cu_seqlens_q.tolist() + [12] * 6
    width = step.block_tables.shape[1]
    assert v["block_tables"][:2, :width].tolist() == step.block_tables.tolist()
    # every view 16-byte aligned, as an upload's are: Triton specializes a captured step's kernels
    # on their pointers as it does an eager step's
    for rows, seqs, blocks, decode in ((24, 3, 7, False), (3, 3, 5, True), (32, 8, 12, False)):
        odd = GraphInputs(rows, seqs, max_blocks=blocks, device=DEVICE, decode=decode)
        assert all(view.data_ptr() % 16 == 0 for view in odd.views.values())


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_decode_through_graph_inputs_matches_eager(model_dir, speculative):
    """The runner's path with graphs, each captured graph replaced by a stand-in that runs the
    model on the graphs' buffers: a step written into GraphInputs (decode steps, and steps with
    prompt tokens up to 16), the tokens sampled by the step before put in on the device, the
    logits of its rows, under overlap scheduling. Greedy and seeded rows, prompts of several
    lengths (steps of 1 to 5 sequences on graphs of 1 to 8), and max_num_batched_tokens small
    enough that prompts are chunked beside decodes: the tokens of the eager engine that completes
    each step before the next (no token carried on the device). `speculative`: n-gram proposals,
    whose verify steps replay the verify ladder's graphs (attention by the decode kernel)."""
    from nanovllm_final import LLM

    path = str(model_dir("qwen3"))
    prompts = [
        [(5 * i + j) % 90 + 3 for j in range(length)] for i, length in enumerate((3, 11, 6, 17, 9))
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=6 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    options = dict(
        device=DEVICE.type,
        dtype="float32",
        enforce_eager=True,
        attention_backend="triton",
        max_model_len=64,
        kvcache_block_size=BLOCK,
        max_num_seqs=8,
        max_num_batched_tokens=16,
    )
    if speculative:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2}
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
        prompts = [p + p for p in prompts]  # proposals from the prompts' own repeats
    with LLM(path, overlap_scheduling=False, **options) as eager:
        expected = [o["token_ids"] for o in eager.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **options) as llm:
        runner = llm.engine.model_runner
        graphs = CUDAGraphs(
            max_num_seqs=8,
            max_prompt_tokens=16,
            max_model_len=64,
            block_size=BLOCK,
            hidden_size=llm.engine.model_config.hidden_size,
            dtype=runner.dtype,
            device=runner.device,
            verify_tokens=3 if speculative else 0,
            max_step_tokens=16,
        )
        graphs.graphs = recorded(graphs, runner.model)
        runner.cuda_graphs = graphs
        got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert graphs.num_replays["prompt"] > 0
        if speculative:
            assert llm.metrics()["spec_decode_num_accepted_tokens"] > 0
            assert graphs.num_replays["verify"] > 0
            assert got == expected
            return
        assert graphs.num_replays["decode"] > 0
        # a decode-shaped step one row of which samples nothing: the logits of the other rows
        chunk = _seq(9, 4, 3)
        chunk.num_scheduled_tokens = 1
        step = build_step_input([_seq(9, 8, 0), chunk, _seq(5, 4, 6)], BLOCK)
        replayed = runner.execute(step)  # (2, vocab), through a graph of 4 rows
        runner.cuda_graphs = None
        assert replayed.shape[0] == 2
        torch.testing.assert_close(
            replayed, runner.execute(step), atol=1e-4, rtol=1e-4
        )  # the padded batch's GEMMs may round otherwise
    assert got == expected
