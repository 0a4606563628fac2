"""The public face: `LLM(model_dir, **options).generate(prompts, sampling_params)`."""

import pathlib

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from .config import EngineConfig, ModelConfig
from .engine.llm_engine import LLMEngine
from .engine.sequence import Sequence
from .models import check_architecture
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | pathlib.Path, **options):
        self.config = EngineConfig.from_options(model, **options)
        self.model_config = ModelConfig.from_dir(model)
        check_architecture(self.model_config)
        self.config.max_model_len = min(
            self.config.max_model_len, self.model_config.max_position_embeddings
        )
        if not any(
            (pathlib.Path(model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
        ):
            raise FileNotFoundError(
                f"{model} has no tokenizer files (tokenizer.json / tokenizer_config.json)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.engine = LLMEngine(self.config, self.model_config)

    @property
    def stats(self) -> list[dict]:
        """Per-step records of the engine (see LLMEngine.step)."""
        return self.engine.stats

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """Complete every prompt; returns {"text", "token_ids"} per prompt, in prompt order."""
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down; create a new one")
        token_lists = [self._encode(i, p) for i, p in enumerate(self._as_list(prompts))]
        params = self._params_per_prompt(sampling_params, len(token_lists))
        seqs = [Sequence(ids, p) for ids, p in zip(token_lists, params)]
        for seq in seqs:
            self.engine.add(seq)
        with tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm) as bar:
            while not self.engine.is_finished():
                bar.update(len(self.engine.step()))
        return [
            {
                "text": self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True),
                "token_ids": seq.completion_token_ids,
            }
            for seq in seqs
        ]

    # ---- input checks: every problem is reported before any work starts ----

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        return list(prompts)

    def _encode(self, index: int, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            # verbose=False: no transformers warning about the tokenizer's own length limit; max_model_len is checked below
            ids = self.tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {index}: token ids {bad[:5]} are outside the vocabulary [0, {self.model_config.vocab_size})"
                )
        else:
            raise ValueError(
                f"prompt {index} must be a string or a list of ints, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; max_model_len is {self.config.max_model_len}, "
                "which must leave room for at least one generated token"
            )
        return ids

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {n} prompts; pass one, or one per prompt"
            )
        if not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError("sampling_params must be SamplingParams objects")
        return sampling_params

    # ---- resources ----

    def shutdown(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
