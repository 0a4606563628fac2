import torch

from ..config import EngineConfig, ModelConfig
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

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> list[int]:
        """The naive step: feed every token of every sequence, keep the last position's logits."""
        input_ids, positions, cu_seqlens = [], [], [0]
        for seq in seqs:
            input_ids.extend(seq.token_ids)
            positions.extend(range(len(seq)))
            cu_seqlens.append(cu_seqlens[-1] + len(seq))
        set_context(Context(cu_seqlens_q=cu_seqlens))
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
        del self.model
