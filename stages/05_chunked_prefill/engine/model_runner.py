import torch

from ..config import EngineConfig, ModelConfig
from ..layers.attention import Attention, resolve_backend
from ..layers.context import Context, set_context
from ..layers.sampler import Sampler
from ..models import build_model
from ..models.loader import load_weights
from ..sampling_params import SamplingParams
from .sequence import Sequence


def warmup_lengths(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """Prompt lengths of the warm-up step: as many tokens as a step may hold (the token
    budget, or one prompt of max_model_len when that is longer) in as many sequences as a
    step may sample (max_num_seqs, as at decode), the first one as long as a prompt may be."""
    num_tokens = min(max(max_num_batched_tokens, max_model_len), max_num_seqs * max_model_len)
    num_seqs = min(max_num_seqs, num_tokens)
    first = min(max_model_len, num_tokens - (num_seqs - 1))
    rest, extra = divmod(num_tokens - first, num_seqs - 1) if num_seqs > 1 else (0, 0)
    return [first] + [rest + (i < extra) for i in range(num_seqs - 1)]


class ModelRunner:
    """Owns the model on its device and turns a list of sequences into next tokens."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = torch.device(config.device)
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

    def allocate_kv_cache(self, cfg: ModelConfig) -> None:
        """A pool of blocks of `block_size` slots, as many as memory allows
        (or `num_kvcache_blocks`). Sequences take blocks as they grow."""
        block_bytes = (
            2
            * cfg.num_hidden_layers
            * self.block_size
            * cfg.num_key_value_heads
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
            cfg.num_key_value_heads,
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
            cfg.num_key_value_heads,
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
        self.run(seqs)
        nbytes = scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        return nbytes

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int | None]:
        """Feed each sequence's `num_scheduled_tokens` uncached tokens: a whole prompt, a
        chunk of one, or the newest token at decode. Returns one sampled token per
        sequence, or None for a prompt chunk that does not reach the prompt's end."""
        input_ids, positions, cu_seqlens, slots = [], [], [0], []
        for seq in seqs:
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens  # NEW in 05_chunked_prefill: maybe a chunk
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
        max_seqlen_q = max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]))
        set_context(
            Context(
                cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
                slot_mapping=self._tensor(slots),
                context_lens=self._tensor(
                    [seq.num_cached_tokens + seq.num_scheduled_tokens for seq in seqs], torch.int32
                ),
                block_tables=self._tensor(block_tables, torch.int32),
                max_seqlen_q=max_seqlen_q,
                is_decode=max_seqlen_q
                == 1,  # one new token each: decode kernels (a 1-token chunk is the same shape)
            )
        )
        try:
            hidden = self.model(
                self._tensor(input_ids), self._tensor(positions)
            )  # (tokens, hidden)
        finally:
            set_context(None)
        # NEW in 05_chunked_prefill: sample only where the fed tokens reach the sequence's end
        rows = [
            i
            for i, seq in enumerate(seqs)
            if seq.num_cached_tokens + seq.num_scheduled_tokens == len(seq)
        ]
        if not rows:
            return [None] * len(seqs)
        last = self._tensor([cu_seqlens[i + 1] - 1 for i in rows])  # (rows,)
        logits = self.model.compute_logits(hidden[last])  # (rows, vocab)
        temperatures = torch.tensor(
            [seqs[i].temperature for i in rows], dtype=torch.float32, device=self.device
        )
        sampled = dict(zip(rows, self.sampler(logits, temperatures).tolist()))
        return [sampled.get(i) for i in range(len(seqs))]

    def _tensor(self, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def shutdown(self) -> None:
        del self.model, self.kv_cache
