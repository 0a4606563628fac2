import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..config import EngineConfig, ModelConfig
from ..distributed import broadcast_from_first, destroy_tensor_parallel, init_tensor_parallel, keep_graphs, min_over_ranks, set_tp_rank
from ..layers.attention import Attention, make_backend
from ..layers.context import Context, set_context
from ..layers.sampler import Sampler, apply_penalties, logprobs_of
from ..models import build_model
from ..models.loader import load_weights
from ..sampling_params import SamplingParams
from .sampling_batch import SamplingBatch, build_sampling_batch
from .sequence import Sequence
from .step_input import StepInput, build_step_input

logger = logging.getLogger(__name__)


@functools.cache
def log_once(level: int, message: str) -> None:
    """Logged once per process, not once per engine."""
    logger.log(level, message)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to
    max_num_seqs (at most 512), and max_num_seqs itself."""
    max_bs = min(max_num_seqs, 512)
    return sorted({bs for bs in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if bs <= max_bs} | {max_bs})


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
class SamplerOutput:
    token_ids: list[int]  # one per sampling row
    logprobs: list[dict] | None  # per row {"token_id", "logprob", "top_logprobs"}; None if no row asked


class PendingSample:
    """A step's sampled ids (and logprobs) on their way to the host: the copies are queued
    behind the step on the device, and `result()` waits for them (the step's one sync)."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device):
        self.host = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory on CUDA
        self.done = torch.cuda.Event() if device.type == "cuda" else None
        if self.done is not None:
            self.done.record()

    def result(self) -> SamplerOutput:
        if self.done is not None:
            self.done.synchronize()
        ids, *rest = (t.tolist() for t in self.host)
        if not rest:
            return SamplerOutput(ids, None)
        chosen, top_values, top_ids = rest
        logprobs = [
            {"token_id": t, "logprob": lp, "top_logprobs": dict(zip(i, v))} for t, lp, v, i in zip(ids, chosen, top_values, top_ids)
        ]
        return SamplerOutput(ids, logprobs)


class ModelRunner:
    """Owns the model on its device: the weights, the KV cache, the CUDA graphs.

    One runner per tensor-parallel rank, each holding its shard of the weights and of the
    KV cache; every rank runs `execute` on the same StepInput (engine/workers.py delivers
    it). Only rank 0 gets logits and samples (`sample`). The runner knows nothing of
    schedules or worker processes; sequences appear only in the throwaway warm-up step."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int = 0):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        self.rank, self.world_size = rank, config.tensor_parallel_size
        if self.world_size > 1:  # join the group (rank r uses cuda:r), then build this rank's shard
            if self.device.type == "cuda":
                self.device = torch.device("cuda", rank)
                torch.cuda.set_device(self.device)
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            init_tensor_parallel(rank, self.world_size, backend, config.distributed_init_method, config.distributed_timeout)
        else:
            set_tp_rank(0, 1)
        self.dtype = config.dtype or (model_config.torch_dtype if self.device.type == "cuda" else torch.float32)
        # device memory free before this engine took any: what it uses is measured from here
        self.free_at_start = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        self.model = build_model(model_config, config.max_model_len, self.dtype, self.device)
        load_weights(self.model, config.model)
        self.sampler = Sampler(config.seed, self.device)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kv_heads = self.attention_layers[0].num_kv_heads  # this rank's
        self.attention_backend = make_backend(config.attention_backend, self.device, self.block_size, self.dtype)
        for layer in self.attention_layers:
            layer.backend = self.attention_backend
        self.allocate_kv_cache(model_config)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> graph
        if self.world_size > 1:
            keep_graphs(self.graphs)  # dropped before the group is left (distributed.py says why)
        self.num_graph_replays = 0
        self.last_sampled: torch.Tensor | None = None  # (rows,) the latest step's sampled ids, on rank 0's device
        if self.use_cudagraphs():
            self.capture_cudagraphs(model_config)

    # ---- the KV cache ----

    def allocate_kv_cache(self, cfg: ModelConfig) -> None:
        """A pool of blocks of `block_size` slots, as many as memory allows (or
        `num_kvcache_blocks`). Sequences take blocks as they grow."""
        block_bytes = 2 * cfg.num_hidden_layers * self.block_size * self.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        one_seq = -(-self.config.max_model_len // self.block_size)  # blocks for one max-length sequence
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks == -1:
            # never more than every batch slot at full length could use
            num_blocks = min(self.kv_budget_bytes(cfg) // block_bytes, self.config.max_num_seqs * one_seq)
            if self.world_size > 1:  # the same block ids on every rank
                num_blocks = min_over_ranks(num_blocks, self.device)
        if num_blocks < one_seq:
            raise ValueError(
                f"the KV cache has room for {max(num_blocks, 0)} blocks of {self.block_size} tokens, but one sequence of "
                f"max_model_len={self.config.max_model_len} needs {one_seq}; give the cache more memory "
                "(num_kvcache_blocks, gpu_memory_utilization or cpu_kvcache_bytes) or lower max_model_len"
            )
        self.num_kvcache_blocks = num_blocks
        shape = (2, cfg.num_hidden_layers, num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.bind_kv_cache(self.kv_cache)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = kv_cache[0, i], kv_cache[1, i]  # (blocks, block_size, kv_heads, head_dim)

    def kv_budget_bytes(self, cfg: ModelConfig) -> int:
        """CPU: a fixed budget. CUDA: what is left of `gpu_memory_utilization` of the card
        once this engine's memory (weights, CUDA context) and what its largest step needs on
        top (activations, logits, sampler buffers; measured by a warm-up step) are counted."""
        if self.device.type != "cuda":
            return self.config.cpu_kvcache_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        warmup_bytes = self.warmup(cfg)
        step_bytes = torch.cuda.max_memory_allocated(self.device) - warmup_bytes - torch.cuda.memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        engine_bytes = self.free_at_start - free  # held by this engine now
        budget = total * self.config.gpu_memory_utilization - engine_bytes - step_bytes
        return int(min(budget, free - step_bytes))  # other processes' memory is not ours to take

    def warmup(self, cfg: ModelConfig) -> int:
        """Run the largest step the scheduler may send, with a throwaway cache; return its size.
        It holds the most tokens a step may hold and samples the most rows a step may sample,
        so its peak memory covers every step's activations, logits and sampler buffers."""
        lengths = warmup_lengths(self.config.max_num_batched_tokens, self.config.max_model_len, self.config.max_num_seqs)
        blocks = [-(-n // self.block_size) for n in lengths]  # blocks per sequence
        shape = (2, cfg.num_hidden_layers, sum(blocks), self.block_size, self.num_kv_heads, cfg.head_dim)
        scratch = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.bind_kv_cache(scratch)
        # sampled the costliest way: masks that sort, seeded noise
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, seed=0, max_tokens=1).resolve({})
        seqs, first_block = [], 0
        for length, num_blocks in zip(lengths, blocks):
            seq = Sequence([0] * length, params)
            seq.block_table = list(range(first_block, first_block + num_blocks))
            seq.num_scheduled_tokens = length
            first_block += num_blocks
            seqs.append(seq)
        logits = self.execute(build_step_input(seqs, self.block_size))
        if logits is not None:  # rank 0 samples
            self.sample(logits, build_sampling_batch(seqs, []))
        nbytes = scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        return nbytes

    # ---- a step ----

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """On the device, copied from pinned memory so that the host does not wait for the copy
        (nor for the steps queued before it)."""
        t = torch.from_numpy(array)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def input_ids(self, step: StepInput) -> torch.Tensor:
        """(tokens,) the step's token ids, with the tokens the step before sampled (still on
        the device) put in at `carry_index`; rank 0 sends them to the other ranks."""
        input_ids = self._tensor(step.input_ids)
        if len(step.carry_index):
            if self.rank == 0:
                carried = self.last_sampled[self._tensor(step.carry_rows)]  # (carried,)
            else:
                carried = torch.empty(len(step.carry_index), dtype=torch.int64, device=self.device)
            if self.world_size > 1:
                broadcast_from_first(carried)
            input_ids[self._tensor(step.carry_index)] = carried
        return input_ids

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """Run the model on the step's tokens; logits (rows, vocab) of the sampling rows on rank 0,
        None on the other ranks (and when no row samples)."""
        context = Context(
            cu_seqlens_q=self._tensor(step.cu_seqlens_q),
            slot_mapping=self._tensor(step.slot_mapping),
            context_lens=self._tensor(step.context_lens),
            block_tables=self._tensor(step.block_tables),
            max_seqlen_q=step.max_seqlen_q,
            is_decode=step.is_decode,
        )
        hidden = self.forward(self.input_ids(step), self._tensor(step.positions), context)  # (tokens, hidden)
        if not len(step.sample_rows):
            return None
        return self.model.compute_logits(hidden[self._tensor(step.sample_rows)])  # (rows, vocab) on rank 0

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """Rank 0: penalties, masks and Gumbel-max; logprobs from the raw logits. Queued on the
        device; the ids stay there for the next step's input (`last_sampled`)."""
        raw = logits  # (rows, vocab) in the model's dtype
        if batch.penalties is not None:
            p = batch.penalties
            logits = apply_penalties(
                logits.float(), self._counts(p["output_ids"], logits.shape[1]), self._counts(p["prompt_ids"], logits.shape[1]) > 0,
                self._tensor(p["repetition"]), self._tensor(p["presence"]), self._tensor(p["frequency"]),
            )
        if batch.suppress is not None:
            rows, ids = batch.suppress
            logits = logits.index_put((self._tensor(rows), self._tensor(ids)), torch.tensor(float("-inf"), dtype=logits.dtype, device=self.device))
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)  # (rows,)
        else:
            optional = {name: None if getattr(batch, name) is None else self._tensor(getattr(batch, name)) for name in ("top_k", "top_p", "min_p", "seeds")}
            # every row keeps at most its top_k: a partial sort of max(top_k) columns is enough (known on the host)
            max_k = int(batch.top_k.max()) if batch.top_k is not None and (batch.top_k > 0).all() else None
            token_ids = self.sampler(logits, self._tensor(batch.temperatures), positions=self._tensor(batch.positions), max_k=max_k, **optional)
        self.last_sampled = token_ids
        if batch.num_logprobs is None:
            return PendingSample([token_ids], self.device)
        return PendingSample([token_ids, *logprobs_of(raw, token_ids, batch.num_logprobs)], self.device)

    def _counts(self, token_lists: list[list[int]], vocab_size: int) -> torch.Tensor:
        """(rows, vocab) float32: how often each token occurs in each row's list."""
        width = max(1, max(len(ids) for ids in token_lists))
        padded = np.full((len(token_lists), width), vocab_size, np.int64)  # vocab_size: padding, dropped below
        for i, ids in enumerate(token_lists):
            padded[i, : len(ids)] = ids
        index = self._tensor(padded)
        counts = torch.zeros(len(token_lists), vocab_size + 1, device=self.device)
        return counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))[:, :vocab_size]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
        """A decode step replays the graph captured for the next batch size up; everything
        else runs eagerly."""
        num_seqs = len(input_ids)
        if context.is_decode and self.graphs and num_seqs <= self.graph_sizes[-1]:
            return self.replay(input_ids, positions, context)
        set_context(context)
        try:
            return self.model(input_ids, positions)  # (tokens, hidden)
        finally:
            set_context(None)

    # ---- CUDA graphs ----

    def use_cudagraphs(self) -> bool:
        if self.config.enforce_eager:
            return False
        if self.device.type != "cuda":  # eager by nature, nothing to act on: information, not a warning
            log_once(logging.INFO, f"CUDA graphs need a CUDA device; this {self.device.type} run is eager")
            return False
        if not self.attention_backend.capturable:
            log_once(logging.WARNING, (
                f"the {self.attention_backend.name} attention backend cannot be captured in a CUDA graph, so decode runs "
                "eagerly; attention_backend='triton' captures CUDA graphs (enforce_eager=True: eager on purpose, no warning)"
            ))
            return False
        return True

    @torch.inference_mode()  # no autograd records: the graphs' memory pool holds only what a step needs
    def capture_cudagraphs(self, cfg: ModelConfig) -> None:
        """Record one decode step per batch size of the ladder (`graph_batch_sizes`). A graph
        replays every kernel launch of the step with one call, on fixed buffers: the inputs
        are copied into them before a replay."""
        self.graph_sizes = graph_batch_sizes(self.config.max_num_seqs)
        max_bs = self.graph_sizes[-1]
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self.graph_inputs = {  # static buffers shared by every graph; a graph of size bs uses the first bs rows
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=self.device),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=self.device),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=self.device),
            "block_tables": torch.full((max_bs, max_blocks), -1, dtype=torch.int32, device=self.device),
            "cu_seqlens_q": torch.arange(max_bs + 1, dtype=torch.int32, device=self.device),
        }
        self.graph_output = torch.zeros(max_bs, cfg.hidden_size, dtype=self.dtype, device=self.device)
        pool = None
        for bs in reversed(self.graph_sizes):  # largest first, so smaller graphs fit in its memory pool
            graph = torch.cuda.CUDAGraph()
            set_context(self.graph_context(bs))
            ids, pos = self.graph_inputs["input_ids"][:bs], self.graph_inputs["positions"][:bs]
            self.graph_output[:bs] = self.model(ids, pos)  # warm-up: autotuning and allocations happen outside the graph
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

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context) -> torch.Tensor:
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

    def shutdown(self) -> None:
        self.graphs.clear()
        del self.model, self.kv_cache
        if self.world_size > 1:
            destroy_tensor_parallel()  # leave the group
