import atexit
import gc
import logging

import torch

from ..config import EngineConfig
from ..distributed import (
    broadcast_from_first,
    destroy_tensor_parallel,
    init_tensor_parallel,
    keep_graphs,
    min_over_ranks,
    set_tp_rank,
)
from ..dtypes import kv_cache_torch_dtype
from ..layers.attention import Attention, make_backend
from ..layers.context import Context, set_context
from ..layers.sampler import Path, Sampler
from ..log import log_once
from ..model_config import ModelConfig
from ..models import build_model
from ..models.loader import load_weights
from ..sampling_params import SamplingParams
from .block_manager import blocks_needed
from .cuda_graphs import CUDAGraphs
from .prompt_logprobs import score_rows
from .sampling import PendingSample, SamplingBatch, batch_path, build_sampling_batch, sample
from .sequence import Sequence
from .spec_verify import PendingVerify, verify_batch, verify_step, warmup_proposals
from .step_input import StepInput, build_step_input, upload

logger = logging.getLogger(__name__)


def warmup_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the warm-up step: as many tokens as a step may hold (the token
    budget, or one prompt of max_model_len when that is longer) in as many sequences as a
    step may sample (max_num_seqs, as at decode), the first one as long as a prompt may be."""
    num_tokens = min(max(max_num_batched_tokens, max_model_len), max_num_seqs * max_model_len)
    num_seqs = min(max_num_seqs, num_tokens)
    first = min(max_model_len, num_tokens - (num_seqs - 1))
    rest, extra = divmod(num_tokens - first, num_seqs - 1) if num_seqs > 1 else (0, 0)
    return [first] + [rest + (i < extra) for i in range(num_seqs - 1)]


atexit.register(
    gc.unfreeze
)  # a runner never shut down leaves nothing frozen for the interpreter's teardown


class ModelRunner:
    """Owns the model on its device: builds it (weights, sampler, CUDA graphs), sizes and
    holds the KV cache, and executes steps.

    One runner per tensor-parallel rank, each holding its shard of the weights and of the
    KV cache; every rank runs `execute` on the same StepInput (engine/workers.py delivers
    it). Only rank 0 gets logits, which the engine turns into tokens with `sample`
    (engine/sampling.py). The runner knows nothing of schedules or worker processes;
    sequences appear only in the throwaway warm-up step."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, rank: int = 0):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
        self.rank, self.world_size = rank, config.tensor_parallel_size
        self.join_tensor_parallel()
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
        self.prompt_scores = None  # the last step's prompt logprobs (execute)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kv_heads = self.attention_layers[0].num_kv_heads  # this rank's
        self.kv_dtype = kv_cache_torch_dtype(
            config.kv_cache_dtype, self.dtype
        )  # what the cache stores
        self.attention_backend = make_backend(
            config.attention_backend, self.device, self.block_size, self.dtype, self.kv_dtype
        )
        for layer in self.attention_layers:
            layer.backend = self.attention_backend
        if self.kv_dtype != self.dtype:
            self.set_kv_scales()
        self.cuda_graphs: CUDAGraphs | None = None  # none yet: the warm-up below runs eagerly
        self.allocate_kv_cache(model_config)
        if self.use_cudagraphs():
            self.capture_cuda_graphs(model_config)
        if self.device.type == "cuda":  # on a CPU a step outlasts any collection
            # What exists now (the libraries, the model, its captured graphs) lives as long as the
            # runner: frozen, it is out of the collector's reach, so a full collection between two steps
            # walks only what the requests allocate (walking it all stalled a Llama-3.2-1B step ~0.25 s).
            gc.collect()
            gc.freeze()

    def join_tensor_parallel(self) -> None:
        """Join the group (rank r uses cuda:r), before this rank's shard is built."""
        config, rank = self.config, self.rank
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

    @property
    def num_graph_replays(self) -> int:
        return sum(self.cuda_graphs.num_replays.values()) if self.cuda_graphs is not None else 0

    # ---- the KV cache ----

    def set_kv_scales(self) -> None:
        """An fp8 cache's scales: 1.0 for every layer and kv head (vLLM's default without
        calibration), (kv_heads,) float32 device tensors outside the block pool that a captured
        CUDA graph reads by pointer. Chosen by measurement (benchmarks/kv_cache_quality.py,
        nanovllm_final/README.md): e4m3's relative step is the same at any scale in its normal
        range, so a per-head amax / 448 scale gained nothing there, and one calibrated on other
        prompts clips what exceeds its amax; with 1.0 only values beyond +-448 clip (the K/V
        measured peak below 9). Calibrating in the warm-up step would see token 0 only (in
        layer 0, one V vector at every position), and on the first prefill would make every
        later request's tokens depend on which request came first."""
        for layer in self.attention_layers:
            layer.k_scale, layer.v_scale = (
                torch.ones(self.num_kv_heads, dtype=torch.float32, device=self.device) for _ in "kv"
            )

    def kv_block_bytes(self, cfg: ModelConfig) -> int:
        """Bytes of one block, K and V of every layer: half of bfloat16's for an fp8 cache."""
        return (
            2
            * cfg.num_hidden_layers
            * self.block_size
            * self.num_kv_heads
            * cfg.head_dim
            * self.kv_dtype.itemsize
        )

    def allocate_kv_cache(self, cfg: ModelConfig) -> None:
        """A pool of blocks of `block_size` slots, as many as memory allows (or
        `num_kvcache_blocks`). Sequences take blocks as they grow."""
        block_bytes = self.kv_block_bytes(cfg)
        one_seq = blocks_needed(
            self.config.max_model_len, self.block_size
        )  # blocks for one max-length sequence
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks == -1:
            # never more than every batch slot at full length could use
            num_blocks = min(
                self.kv_budget_bytes(cfg) // block_bytes, self.config.max_num_seqs * one_seq
            )
            if self.world_size > 1:  # the same block ids on every rank
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
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
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
        blocks = [blocks_needed(n, self.block_size) for n in lengths]  # blocks per sequence
        shape = (
            2,
            cfg.num_hidden_layers,
            sum(blocks),
            self.block_size,
            self.num_kv_heads,
            cfg.head_dim,
        )
        scratch = torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        self.bind_kv_cache(scratch)
        # sampled the costliest way: masks that sort, seeded noise
        params = SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, seed=0, max_tokens=1
        ).resolve({})
        seqs, first_block = [], 0
        for length, num_blocks in zip(lengths, blocks):
            seq = Sequence([0] * length, params)
            seq.block_table = list(range(first_block, first_block + num_blocks))
            seq.num_scheduled_tokens = length
            first_block += num_blocks
            seqs.append(seq)
        spec = self.config.speculative_config
        if spec is not None:  # its rows verify proposals, as many as a verify step's
            warmup_proposals(seqs, spec.num_speculative_tokens)
        logits = self.execute(build_step_input(seqs, self.block_size))
        if logits is not None:  # rank 0 samples
            pending = self.sample(
                logits, build_sampling_batch(seqs, []) if spec is None else verify_batch(seqs, [])
            )
            if spec is not None:
                pending.result()
        nbytes = scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        return nbytes

    # ---- a step ----

    def input_ids(self, t: dict[str, torch.Tensor], carried: torch.Tensor | None) -> torch.Tensor:
        """(tokens,) the step's token ids (`t`: its arrays on the device), with the tokens the step
        before sampled (`carried`, still on rank 0's device) put in at `carry_index`; rank 0 sends
        them to the other ranks."""
        input_ids, num_carried = t["input_ids"], len(t["carry_index"])
        if num_carried == len(
            input_ids
        ):  # a decode step of carried tokens only: carry_index is 0, 1, ..., in place
            if self.rank == 0:
                torch.index_select(carried, 0, t["carry_rows"], out=input_ids)
            if self.world_size > 1:
                broadcast_from_first(input_ids)
        elif num_carried:
            if self.rank == 0:
                carried = carried[t["carry_rows"]]  # (carried,)
            else:
                carried = torch.empty(num_carried, dtype=torch.int64, device=self.device)
            if self.world_size > 1:
                broadcast_from_first(carried)
            input_ids[t["carry_index"]] = carried
        return input_ids

    @torch.inference_mode()
    def execute(self, step: StepInput, carried: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the model on the step's tokens; logits (rows, vocab) of the sampling rows on rank 0,
        None on the other ranks (and when no row samples). `carried`: on rank 0, the sampled ids
        of the step in flight (overlap scheduling), which feed this one."""
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_replay(step):
            t = graphs.write(step)  # straight into the graph's inputs
            self.input_ids(t, carried)
            hidden = graphs.replay(step)  # (tokens, hidden)
        else:
            arrays = step.arrays()
            t = dict(
                zip(arrays, upload(list(arrays.values()), self.device))
            )  # the step's arrays on the device, one copy
            context = Context(
                cu_seqlens_q=t["cu_seqlens_q"],
                slot_mapping=t["slot_mapping"],
                context_lens=t["context_lens"],
                block_tables=t["block_tables"],
                max_seqlen_q=step.max_seqlen_q,
                is_decode=step.is_decode,
                decode_order=t["decode_order"]
                if step.is_decode
                else None,  # only decode kernels read it
            )
            hidden = self.forward(
                self.input_ids(t, carried), t["positions"], context
            )  # (tokens, hidden)
        # prompt_logprobs: rank 0 keeps the step's scores (on their way to the host) for the engine to read
        self.prompt_scores = None
        if step.scoring is not None:
            self.prompt_scores = score_rows(
                self.model, hidden, step.scoring, self.config.max_num_seqs
            )
        num_rows = len(step.sample_rows)
        if not num_rows:
            return None
        rows = (
            hidden if num_rows == len(hidden) else hidden[t["sample_rows"]]
        )  # every token samples: each decode row
        return self.model.compute_logits(rows)  # (rows, vocab) on rank 0

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample | PendingVerify:
        """Rank 0: the tokens of `execute`'s logits (rows, vocab), a row per row of `batch`,
        queued on the device. `batch_path` picks the draw: a verify step's rejection sampler, or
        one of the sampler's (engine/sampling.py)."""
        path = batch_path(batch, logits)
        if path is Path.VERIFY:
            return verify_step(self.sampler, logits, batch)
        return sample(self.sampler, logits, batch, path)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, context: Context
    ) -> torch.Tensor:
        """The model on a step's tokens, eagerly (a step with a captured graph replays it in
        `execute`)."""
        set_context(context)
        try:
            return self.model(input_ids, positions)  # (tokens, hidden)
        finally:
            set_context(None)

    # ---- CUDA graphs (captured and replayed by cuda_graphs.py) ----

    def capture_cuda_graphs(self, model_config: ModelConfig) -> None:
        """Capture the decode steps' graphs (and, where the backend can, those with prompts, and
        those of verify steps whose attention is its decode's)."""
        config, spec = self.config, self.config.speculative_config
        prompt_tokens = (
            min(config.max_num_batched_tokens, config.cuda_graph_max_tokens)
            if self.attention_backend.capturable_prefill
            else 0
        )
        verify_tokens = 0 if spec is None else 1 + spec.num_speculative_tokens
        self.cuda_graphs = CUDAGraphs(
            config.max_num_seqs,
            prompt_tokens,
            config.max_model_len,
            self.block_size,
            model_config.hidden_size,
            self.dtype,
            self.device,
            verify_tokens=verify_tokens
            if verify_tokens <= self.attention_backend.decode_queries
            else 0,
            max_step_tokens=config.max_num_batched_tokens,
        )
        if self.world_size > 1:  # dropped before the group is left (distributed.py says why)
            keep_graphs(self.cuda_graphs.graphs)
        self.cuda_graphs.capture(self.model)

    def use_cudagraphs(self) -> bool:
        if self.config.enforce_eager:
            return False
        if (
            self.device.type != "cuda"
        ):  # eager by nature, nothing to act on: information, not a warning
            log_once(
                logger,
                logging.INFO,
                f"CUDA graphs need a CUDA device; this {self.device.type} run is eager",
            )
            return False
        if not self.attention_backend.capturable:
            log_once(
                logger,
                logging.WARNING,
                (
                    f"the {self.attention_backend.name} attention backend cannot be captured in a CUDA graph, so decode runs "
                    "eagerly; attention_backend='triton' captures CUDA graphs (enforce_eager=True: eager on purpose, no warning)"
                ),
            )
            return False
        return True

    def shutdown(self) -> None:
        if self.cuda_graphs is not None:
            self.cuda_graphs.graphs.clear()
        del self.model, self.kv_cache
        gc.unfreeze()  # what the runner held is collectable again
        if self.world_size > 1:
            destroy_tensor_parallel()  # leave the group
