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
        num_tokens = sum(len(seq) for seq in seqs)
        # after its first step, all but the newest token of a sequence were seen before
        recomputed = sum(len(seq) - 1 for seq in seqs if seq.num_completion_tokens > 0)
        token_ids = self.model_runner.run(seqs)
        finished = self.scheduler.postprocess(seqs, token_ids)
        self.stats.append(
            {
                "step": len(self.stats),
                "num_seqs": len(seqs),
                "num_tokens": num_tokens,  # tokens run through the model
                "recomputed_tokens": recomputed,  # work a KV cache would have saved
                "seconds": time.perf_counter() - start,
            }
        )
        return finished

    def shutdown(self) -> None:
        self.model_runner.shutdown()
