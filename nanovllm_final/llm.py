"""The public face: `LLM(model, **options)` with generate, chat and stream, all driven by
one loop over the engine's requests (`LLM._run`)."""

import pathlib
from collections.abc import Iterator

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from .config import EngineConfig, ModelConfig
from .engine.llm_engine import LLMEngine
from .hub import resolve_model
from .models import check_architecture
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict]


class LLM:
    def __init__(self, model: str | pathlib.Path, **options):
        """`model`: a checkpoint directory, or a hub id ("Qwen/Qwen3-0.6B") in the local Hugging Face
        cache. `options`: the engine options of EngineConfig (see the README)."""
        self.model_name = str(model)
        path = resolve_model(model)
        self.config = EngineConfig.from_options(path, **options)
        self.model_config = ModelConfig.from_dir(path)
        check_architecture(self.model_config)
        self.config.max_model_len = min(self.config.max_model_len, self.model_config.max_position_embeddings)
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise FileNotFoundError(f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.engine = LLMEngine(self.config, self.model_config, self.tokenizer)

    @property
    def stats(self) -> list[dict]:
        """One record per engine step (see engine/metrics.py)."""
        return self.engine.stats

    def metrics(self) -> dict:
        """A summary: requests, tokens, throughput, TTFT/TPOT percentiles, prefix-cache hit rate,
        KV-cache usage (now and peak), preemptions."""
        return self.engine.metrics.summary()

    def encode_chat(self, messages: Messages, chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids of a conversation in the model's chat template, ending with the
        assistant's generation prompt (`chat_template_kwargs`, e.g. {"enable_thinking": False},
        go to the template)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages):
            raise ValueError('a conversation must be a list of {"role": ..., "content": ...} dicts')
        if self.tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer of {self.model_name} has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {}))
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """The token ids of a text prompt, as generate sees them (no special tokens added).
        verbose=False: no transformers warning about the tokenizer's own length limit;
        max_model_len is what bounds a prompt, and generate checks it."""
        return self.tokenizer.encode(text, add_special_tokens=False, verbose=False)

    # ---- generation ----

    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """Complete every prompt (a string or token ids). Returns, per prompt in order, a dict:
        text, token_ids, finish_reason, logprobs (of the first completion), prompt_token_ids,
        metrics, and outputs (all n completions: text, token_ids, finish_reason, logprobs)."""
        request_ids = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            for out in self._run(request_ids, finished_only=True):
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        return [final[rid].as_dict() for rid in request_ids]

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """Answer one conversation (a list of {"role", "content"}) or a list of them; returns what generate returns."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.encode_chat(c, chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> Iterator[dict]:
        """Yield events as tokens are produced: {"index" (the prompt's), "completion" (0..n-1),
        "text" and "token_ids" (new since the last event), "finished", "finish_reason"}.
        Joining one completion's texts gives generate's text."""
        request_ids = self._submit(prompts, sampling_params)
        index = {rid: i for i, rid in enumerate(request_ids)}
        reported = set()  # (request, completion) pairs whose end was reported
        for out in self._run(request_ids):
            for c in out.outputs:
                ended = c.finished and (out.request_id, c.index) not in reported
                if c.delta_token_ids or c.delta_text or ended:
                    if ended:
                        reported.add((out.request_id, c.index))
                    yield {"index": index[out.request_id], "completion": c.index, "text": c.delta_text,
                           "token_ids": c.delta_token_ids, "finished": c.finished, "finish_reason": c.finish_reason}

    def _run(self, request_ids: list[str], finished_only: bool = False) -> Iterator[RequestOutput]:
        """The one loop: step the engine until these requests finish; yield their outputs as they come
        (`finished_only`: their final outputs only). If the caller stops early (an exception, or a
        stream left unfinished), the rest are aborted."""
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down; create a new one")
        waiting = set(request_ids)
        try:
            while waiting:
                for out in self.engine.step(finished_only):
                    if out.request_id in waiting:
                        if out.finished:
                            waiting.discard(out.request_id)
                        yield out
        finally:
            for rid in waiting:
                self.engine.abort_request(rid)
            if waiting:
                self.engine.step()  # hand out (and drop) the aborted requests' last outputs

    # ---- input checks: every problem is reported before any work starts ----

    def _submit(self, prompts: list[Prompt], sampling_params) -> list[str]:
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down; create a new one")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        token_lists = [self._encode(i, p) for i, p in enumerate(prompts)]
        params = self._params_per_prompt(sampling_params, len(token_lists))
        for p in params:
            self.engine.check_params(p)
            p.resolve(self.model_config.generation_defaults)  # generation_config.json's values must pass too
        return [self.engine.add_request(ids, p) for ids, p in zip(token_lists, params)]

    def _encode(self, index: int, prompt: Prompt) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        problem = self.engine.prompt_problem(ids)
        if problem:
            raise ValueError(f"prompt {index} {problem}")
        return list(ids)

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts; pass one, or one per prompt")
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
