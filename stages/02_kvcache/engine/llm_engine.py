import time

from ..config import EngineConfig, ModelConfig
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence


class LLMEngine:
    """The engine loop: schedule, run the model once, append the sampled tokens."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig):
        self.scheduler = Scheduler(config, model_config.eos_token_ids)
        self.model_runner = ModelRunner(config, model_config)
        self.stats: list[dict] = []  # one record per step, for notebooks and benchmarks

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def step(self) -> list[Sequence]:
        """One model forward; returns the sequences that finished in it."""
        start = time.perf_counter()
        seqs = self.scheduler.schedule()
        num_tokens = sum(len(seq) - seq.num_cached_tokens for seq in seqs)
        is_prefill = any(
            seq.num_cached_tokens == 0 for seq in seqs
        )  # NEW in 02_kvcache: whole prompts, not one token each
        token_ids = self.model_runner.run(seqs)
        finished = self.scheduler.postprocess(seqs, token_ids)
        self.stats.append(
            {
                "step": len(self.stats),
                "num_seqs": len(seqs),
                "num_tokens": num_tokens,  # tokens run through the model
                "recomputed_tokens": 0,  # NEW in 02_kvcache: the cache remembers every earlier token
                "is_prefill": is_prefill,
                "seconds": time.perf_counter() - start,
                # NEW in 02_kvcache: slots held by the batch's rows vs slots holding real K/V
                "kv_slots_reserved": len(self.scheduler.running)
                * self.model_runner.config.max_model_len,
                "kv_slots_used": sum(seq.num_cached_tokens for seq in self.scheduler.running),
                "kv_slots_allocated": self.model_runner.kv_slots_reserved,
            }
        )
        return finished

    def shutdown(self) -> None:
        self.model_runner.shutdown()
