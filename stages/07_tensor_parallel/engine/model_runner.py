import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..distributed import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    keep_graphs,
    min_over_ranks,
    set_tp_rank,
)
from ..layers.attention import Attention, resolve_backend
from ..layers.context import Context, set_context
from ..layers.sampler import Sampler
from ..models import build_model
from ..models.loader import load_weights
from ..sampling_params import SamplingParams
from .sequence import Sequence

logger = logging.getLogger(__name__)


@functools.cache
def log_once(level: int, message: str) -> None:
    """Logged once per process, not once per engine."""
    logger.log(level, message)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up
    to max_num_seqs (at most 512), and max_num_seqs itself."""
    max_bs = min(max_num_seqs, 512)
    return sorted(
        {bs for bs in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if bs <= max_bs} | {max_bs}
    )


def graph_for(num_seqs: int, sizes: list[int]) -> int:
    """The captured size a decode step of `num_seqs` sequences is padded up to."""
    return next(size for size in sizes if size >= num_seqs)


def warmup_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the warm-up step: as many tokens as a step may hold (the token
    budget, or one prompt of max_model_len when that is longer) in as many sequences as a
    step may sample (max_num_seqs, as at decode), the first one as long as a prompt may be."""
    num_tokens = min(max(max_num_batched_tokens, max_model_len), max_num_seqs * max_model_len)
    num_seqs = min(max_num_seqs, num_tokens)
    first = min(max_model_len, num_tokens - (num_seqs - 1))
    rest, extra = divmod(num_tokens - first, num_seqs - 1) if num_seqs > 1 else (0, 0)
    return [first] + [rest + (i < extra) for i in range(num_seqs - 1)]


@dataclass
class StepInputs:
    """NEW in 07_tensor_parallel: one step's model inputs as flat arrays. Rank 0 builds them
    from its sequences and sends the same object to every worker: a few KB, where the
    sequences themselves would carry token lists that grow with every step."""

    input_ids: np.ndarray  # (tokens,) int64: the fed tokens, sequence after sequence
    positions: np.ndarray  # (tokens,) int64
    cu_seqlens: np.ndarray  # (seqs+1,) int32: where each sequence's tokens start
    slot_mapping: np.ndarray  # (tokens,) int64: the cache slot of each fed token
    context_lens: np.ndarray  # (seqs,) int32: tokens in the cache after this step
    block_tables: np.ndarray  # (seqs, max_blocks) int32, padded with -1
    sample_rows: np.ndarray  # (rows,) int64: the sequences whose fed tokens reach their end
    temperatures: np.ndarray  # (rows,) float32: theirs (only rank 0 samples)


class ModelRunner:
    """Owns the model on its device and turns a list of sequences into next tokens.

    NEW in 07_tensor_parallel: one runner per rank, each holding its shard of the weights
    and of the KV cache. Rank 0's runner lives in the engine; every rank runs `execute` on
    the same StepInputs (engine/workers.py delivers them); only rank 0 samples."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int = 0):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        # NEW in 07_tensor_parallel: join the group, then build this rank's shard (rank r uses cuda:r)
        self.rank, self.world_size = rank, config.tensor_parallel_size
        self.num_kv_heads = (
            model_config.num_key_value_heads // self.world_size
        )  # this rank's KV heads
        if self.world_size > 1:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", rank)
                torch.cuda.set_device(self.device)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_tensor_parallel(
                rank,
                self.world_size,
                backend,
                config.distributed_init_method,
                config.distributed_timeout,
            )
        else:
            set_tp_rank(0, 1)
        self.dtype = config.dtype or (
            model_config.torch_dtype if self.device.type == "cuda" else torch.float32
        )
        # device memory free before this engine took any: what it uses is measured from here
        self.free_at_start = (
            torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        )
        self.model = build_model(model_config, config.max_model_len, self.dtype, self.device)
        load_weights(self.model, config.model)
        self.sampler = Sampler(config.seed, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.attention_backend = resolve_backend(
            config.attention_backend, self.device, self.block_size, self.dtype
        )
        for layer in self.attention_layers:
            layer.set_backend(self.attention_backend)
        self.allocate_kv_cache(model_config)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> graph
        if self.world_size > 1:
            keep_graphs(self.graphs)  # NEW in 07_tensor_parallel: dropped before the group is left
        self.num_graph_replays = 0
        if self.use_cudagraphs():
            self.capture_cudagraphs(model_config)

    def allocate_kv_cache(self, cfg: ModelConfig) -> None:
        """A pool of blocks of `block_size` slots, as many as memory allows
        (or `num_kvcache_blocks`). Sequences take blocks as they grow."""
        block_bytes = (
            2
            * cfg.num_hidden_layers
            * self.block_size
            * self.num_kv_heads
            * cfg.head_dim
            * self.dtype.itemsize
        )
        one_seq = -(
            -self.config.max_model_len // self.block_size
        )  # blocks for one max-length sequence
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks == -1:
            # never more than every batch slot at full length could use
            num_blocks = min(
                self.kv_budget_bytes(cfg) // block_bytes, self.config.max_num_seqs * one_seq
            )
            if self.world_size > 1:  # NEW in 07_tensor_parallel: the same block ids on every rank
                num_blocks = min_over_ranks(num_blocks, self.device)
        if num_blocks < one_seq:
            raise ValueError(
                f"the KV cache has room for {max(num_blocks, 0)} blocks of {self.block_size} tokens, but one sequence of "
                f"max_model_len={self.config.max_model_len} needs {one_seq}; give the cache more memory "
                "(num_kvcache_blocks, gpu_memory_utilization or cpu_kvcache_bytes) or lower max_model_len"
            )
        self.num_kvcache_blocks = num_blocks
        shape = (
            2,
            cfg.num_hidden_layers,
            num_blocks,
            self.block_size,
            self.num_kv_heads,
            cfg.head_dim,
        )
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.bind_kv_cache(self.kv_cache)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = (
                kv_cache[0, i],
                kv_cache[1, i],
            )  # (blocks, block_size, kv_heads, head_dim)

    def kv_budget_bytes(self, cfg: ModelConfig) -> int:
        """CPU: a fixed budget. CUDA: what is left of `gpu_memory_utilization` of the card
        once this engine's memory (weights, CUDA context) and what its largest step needs on
        top (activations, logits, sampler buffers; measured by a warm-up step) are counted."""
        if self.device.type != "cuda":
            return self.config.cpu_kvcache_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        warmup_bytes = self.warmup(cfg)
        step_bytes = (
            torch.cuda.max_memory_allocated(self.device)
            - warmup_bytes
            - torch.cuda.memory_allocated(self.device)
        )
        free, total = torch.cuda.mem_get_info(self.device)
        engine_bytes = self.free_at_start - free  # held by this engine now
        budget = total * self.config.gpu_memory_utilization - engine_bytes - step_bytes
        return int(min(budget, free - step_bytes))  # other processes' memory is not ours to take

    def warmup(self, cfg: ModelConfig) -> int:
        """Run the largest step the scheduler may send, with a throwaway cache; return its size.
        It holds the most tokens a step may hold and samples the most rows a step may sample,
        so its peak memory covers every step's activations, logits and sampler buffers."""
        lengths = warmup_lengths(
            self.config.max_num_batched_tokens, self.config.max_model_len, self.config.max_num_seqs
        )
        blocks = [-(-n // self.block_size) for n in lengths]  # blocks per sequence
        shape = (
            2,
            cfg.num_hidden_layers,
            sum(blocks),
            self.block_size,
            self.num_kv_heads,
            cfg.head_dim,
        )
        scratch = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.bind_kv_cache(scratch)
        seqs, first_block = [], 0
        for length, num_blocks in zip(lengths, blocks):
            seq = Sequence([0] * length, SamplingParams(temperature=1.0, max_tokens=1))
            seq.block_table = list(range(first_block, first_block + num_blocks))
            seq.num_scheduled_tokens = length
            first_block += num_blocks
            seqs.append(seq)
        self.execute(self.prepare(seqs))  # this rank only: every rank warms up on its own
        nbytes = scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        return nbytes

    def run(
        self,
        seqs: list[Sequence],
        workers: "WorkerGroup | None" = None,  # noqa: F821 (workers.py)
    ) -> list[int | None]:
        """Feed each sequence's `num_scheduled_tokens` uncached tokens: a whole prompt, a
        chunk of one, or the newest token at decode. Returns one sampled token per
        sequence, or None for a prompt chunk that does not reach the prompt's end."""
        step = self.prepare(seqs)
        # NEW in 07_tensor_parallel: on every rank (`workers` runs it on ranks 1..N-1 too)
        sampled = (
            self.execute(step) if workers is None else workers.call("execute", self.execute, step)
        )
        tokens: list[int | None] = [None] * len(seqs)
        for row, token in zip(step.sample_rows.tolist(), sampled):
            tokens[row] = token
        return tokens

    def prepare(self, seqs: list[Sequence]) -> StepInputs:
        """NEW in 07_tensor_parallel: the step's inputs, built on rank 0 from its sequences."""
        input_ids, positions, cu_seqlens, slots = [], [], [0], []
        for seq in seqs:
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens  # maybe a chunk
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + end - start)
            slots.extend(
                seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)
            )
        max_blocks = max(len(seq.block_table) for seq in seqs)
        block_tables = [
            seq.block_table + [-1] * (max_blocks - len(seq.block_table)) for seq in seqs
        ]
        # sample only where the fed tokens reach the sequence's end
        rows = [
            i
            for i, seq in enumerate(seqs)
            if seq.num_cached_tokens + seq.num_scheduled_tokens == len(seq)
        ]
        return StepInputs(
            input_ids=np.array(input_ids, dtype=np.int64),
            positions=np.array(positions, dtype=np.int64),
            cu_seqlens=np.array(cu_seqlens, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int64),
            context_lens=np.array(
                [seq.num_cached_tokens + seq.num_scheduled_tokens for seq in seqs], dtype=np.int32
            ),
            block_tables=np.array(block_tables, dtype=np.int32),
            sample_rows=np.array(rows, dtype=np.int64),
            temperatures=np.array([seqs[i].temperature for i in rows], dtype=np.float32),
        )

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> list[int]:
        """NEW in 07_tensor_parallel: run one step on this rank. Rank 0 returns the sampled
        token of each of `step.sample_rows`; a worker returns []."""
        max_seqlen_q = int(np.diff(step.cu_seqlens).max())
        context = Context(
            cu_seqlens_q=self._tensor(step.cu_seqlens),
            slot_mapping=self._tensor(step.slot_mapping),
            context_lens=self._tensor(step.context_lens),
            block_tables=self._tensor(step.block_tables),
            max_seqlen_q=max_seqlen_q,
            is_decode=max_seqlen_q
            == 1,  # one new token each: decode kernels (a 1-token chunk is the same shape)
        )
        hidden = self.forward(
            self._tensor(step.input_ids), self._tensor(step.positions), context
        )  # (tokens, hidden)
        if not len(step.sample_rows):
            return []
        last = self._tensor(step.cu_seqlens[step.sample_rows + 1].astype(np.int64) - 1)  # (rows,)
        logits = self.model.compute_logits(hidden[last])  # (rows, vocab)
        if logits is None:
            return []  # a worker rank; rank 0 samples
        return self.sampler(logits, self._tensor(step.temperatures)).tolist()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context
    ) -> torch.Tensor:
        """A decode step replays the graph captured for the next batch
        size up; everything else runs eagerly."""
        num_seqs = len(input_ids)
        if context.is_decode and self.graphs and num_seqs <= self.graph_sizes[-1]:
            return self.replay(input_ids, positions, context)
        set_context(context)
        try:
            return self.model(input_ids, positions)  # (tokens, hidden)
        finally:
            set_context(None)

    def use_cudagraphs(self) -> bool:
        if self.config.enforce_eager:
            return False
        if (
            self.device.type != "cuda"
        ):  # eager by nature, nothing to act on: information, not a warning
            logger.info("CUDA graphs need a CUDA device; this %s run is eager", self.device.type)
            return False
        if self.attention_backend == "torch":
            log_once(
                logging.WARNING,
                "the torch attention backend reads sizes on the host and cannot be captured, so decode runs "
                "eagerly; attention_backend='triton' captures CUDA graphs (enforce_eager=True: eager on purpose, no warning)",
            )
            return False
        return True

    @torch.inference_mode()  # no autograd records: the graphs' memory pool holds only what a step needs
    def capture_cudagraphs(self, cfg: ModelConfig) -> None:
        """Record one decode step per batch size of the ladder
        (`graph_batch_sizes`). A graph replays every kernel launch of the
        step with one call, on fixed buffers: the inputs are copied into them before a replay."""
        self.graph_sizes = graph_batch_sizes(self.config.max_num_seqs)
        max_bs = self.graph_sizes[-1]
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.graph_inputs = {  # static buffers shared by every graph; a graph of size bs uses the first bs rows
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=self.device),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "block_tables": torch.full(
                (max_bs, max_blocks), -1, dtype=torch.int32, device=self.device
            ),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=self.device),
        }
        self.graph_output = torch.zeros(
            max_bs, cfg.hidden_size, dtype=self.dtype, device=self.device
        )
        pool = None
        for bs in reversed(
            self.graph_sizes
        ):  # largest first, so smaller graphs fit in its memory pool
            graph = torch.cuda.CUDAGraph()
            set_context(self.graph_context(bs))
            ids, pos = self.graph_inputs["input_ids"][:bs], self.graph_inputs["positions"][:bs]
            self.graph_output[:bs] = self.model(
                ids, pos
            )  # warm-up: autotuning and allocations happen outside the graph
            with torch.cuda.graph(graph, pool):
                self.graph_output[:bs] = self.model(ids, pos)
            pool = pool or graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        set_context(None)

    def graph_context(self, bs: int) -> Context:
        g = self.graph_inputs
        return Context(
            cu_seqlens_q=g["cu_seqlens_q"][: bs + 1],
            slot_mapping=g["slot_mapping"][:bs],
            context_lens=g["context_lens"][:bs],
            block_tables=g["block_tables"][:bs],
            max_seqlen_q=1,
            is_decode=True,
        )

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context
    ) -> torch.Tensor:
        n = len(input_ids)
        bs = graph_for(n, self.graph_sizes)  # pad the batch up to a captured size
        g = self.graph_inputs
        g["input_ids"][:n] = input_ids
        g["positions"][:n] = positions
        g["slot_mapping"][:bs].fill_(-1)  # padding rows store nothing ...
        g["slot_mapping"][:n] = context.slot_mapping
        g["context_lens"][:bs].zero_()  # ... and attend to nothing
        g["context_lens"][:n] = context.context_lens
        width = context.block_tables.shape[1]
        g["block_tables"][:n, :width] = context.block_tables
        self.graphs[bs].replay()
        self.num_graph_replays += 1
        return self.graph_output[:n]  # (seqs, hidden)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.tensor(array, device=self.device)

    def shutdown(self) -> None:
        self.graphs.clear()
        del self.model, self.kv_cache
        if self.world_size > 1:
            destroy_tensor_parallel()  # NEW in 07_tensor_parallel: leave the group
