import torch

from ..config import EngineConfig, ModelConfig
from ..layers.attention import Attention
from ..layers.context import Context, set_context
from ..layers.sampler import Sampler
from ..models import build_model
from ..models.loader import load_weights
from .sequence import Sequence


class ModelRunner:
    """Owns the model on its device and turns a list of sequences into next tokens."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.dtype or (
            model_config.torch_dtype if self.device.type == "cuda" else torch.float32
        )
        self.model = build_model(model_config, config.max_model_len, self.dtype, self.device)
        load_weights(self.model, config.model)
        self.sampler = Sampler(config.seed, self.device)
        self.allocate_kv_cache(model_config)

    def allocate_kv_cache(self, cfg: ModelConfig) -> None:
        """NEW in 02_kvcache: one contiguous row of `max_model_len` slots per batch slot,
        reserved up front whether a sequence will use it or not."""
        rows, length = self.config.max_num_seqs, self.config.max_model_len
        shape = (2, cfg.num_hidden_layers, rows, length, cfg.num_key_value_heads, cfg.head_dim)
        nbytes = torch.Size(shape).numel() * self.dtype.itemsize
        budget = self.kv_budget_bytes()
        if nbytes > budget:
            raise ValueError(
                f"a contiguous KV cache of max_num_seqs={rows} rows x max_model_len={length} slots needs "
                f"{nbytes / 2**30:.2f} GiB but the budget is {budget / 2**30:.2f} GiB; lower max_num_seqs or max_model_len"
            )
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_slots_reserved = rows * length
        attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for i, layer in enumerate(attention_layers):
            layer.k_cache, layer.v_cache = (
                self.kv_cache[0, i],
                self.kv_cache[1, i],
            )  # (rows, length, kv_heads, head_dim)

    def kv_budget_bytes(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - total * (1 - self.config.gpu_memory_utilization))
        return self.config.cpu_kvcache_bytes

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int]:
        """Feed only the tokens whose K/V are not cached yet: the whole prompt at
        prefill, the newest token at decode."""
        input_ids, positions, cu_seqlens, slots = [], [], [0], []
        for seq in seqs:
            start, end = seq.num_cached_tokens, len(seq)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            cu_seqlens.append(cu_seqlens[-1] + end - start)
            slots.extend(seq.cache_row * self.config.max_model_len + p for p in range(start, end))
        set_context(
            Context(
                cu_seqlens_q=cu_seqlens,
                slot_mapping=self._tensor(slots),
                context_lens=[len(seq) for seq in seqs],
                cache_rows=[seq.cache_row for seq in seqs],
            )
        )
        try:
            hidden = self.model(
                self._tensor(input_ids), self._tensor(positions)
            )  # (tokens, hidden)
        finally:
            set_context(None)
        last = self._tensor([end - 1 for end in cu_seqlens[1:]])  # (seqs,)
        logits = self.model.compute_logits(hidden[last])  # (seqs, vocab)
        temperatures = torch.tensor(
            [seq.temperature for seq in seqs], dtype=torch.float32, device=self.device
        )
        return self.sampler(logits, temperatures).tolist()

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def shutdown(self) -> None:
        del self.model, self.kv_cache
