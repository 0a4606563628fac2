"""The public face: `LLM(model, **options)` with generate, chat and stream, all driven by
one loop over the engine's requests (`LLM._run`).

One LLM may be used from several threads, and its streams may be interleaved with each
other and with generate: one lock lets one caller at a time submit or step the engine, and
each step's outputs are routed to the caller whose requests they are, whoever stepped."""

import pathlib
import threading
from collections import deque
from collections.abc import Iterator

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from .config import EngineConfig, ModelConfig
from .engine import front_end
from .engine.llm_engine import LLMEngine
from .hub import resolve_model
from .models import check_architecture
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]  # token ids may be numpy integers (an array, or a list of them)
Messages = list[dict]


class LLM:
    def __init__(self, model: str | pathlib.Path, **options):
        """`model`: a checkpoint directory, or a hub id ("Qwen/Qwen3-0.6B") in the local Hugging Face
        cache. `options`: the engine options of EngineConfig (see the README). A bad option, or a
        checkpoint whose config.json or generation_config.json holds a value the engine cannot
        take, is a ValueError naming the option, or the file and the field."""
        self._lock = threading.RLock()  # the engine and the tokenizer: one caller at a time
        self._routes: dict[
            str, deque[RequestOutput]
        ] = {}  # request id -> the outputs its caller has not read
        self._streams = (
            0  # callers that read every output (stream); generate reads the final ones only
        )
        self._stepping = False
        self._abandoned: list[
            str
        ] = []  # requests of a caller that left during a step: aborted by the next
        self.model_name = str(model)
        path = resolve_model(model)
        self.config = EngineConfig.from_options(path, **options)
        self.model_config = ModelConfig.from_dir(path)
        check_architecture(self.model_config)
        self.config.max_model_len = min(
            self.config.max_model_len, self.model_config.max_position_embeddings
        )
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
            raise FileNotFoundError(
                f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.engine = LLMEngine(self.config, self.model_config, self.tokenizer)

    def _engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("this LLM has been shut down; create a new one")
        return self.engine

    @property
    def stats(self) -> list[dict]:
        """One record per engine step (see engine/metrics.py)."""
        return self._engine().stats

    def metrics(self) -> dict:
        """A summary: requests, tokens, throughput, TTFT/TPOT percentiles, prefix-cache hit rate,
        KV-cache usage (now and peak), preemptions."""
        with self._lock:
            return self._engine().metrics_summary()

    def encode_chat(
        self, messages: Messages, chat_template_kwargs: dict | None = None
    ) -> list[int]:
        """The token ids of a conversation in the model's chat template, ending with the
        assistant's generation prompt (`chat_template_kwargs`, e.g. {"enable_thinking": False},
        go to the template). A message's content is a string or a list of text parts
        ([{"type": "text", "text": ...}], as OpenAI's API sends it); engine/front_end.py says
        what is refused."""
        with self._lock:
            text = front_end.render_chat(self.tokenizer, messages, chat_template_kwargs)
            return front_end.encode(self.tokenizer, text, "messages")

    def encode(self, text: str) -> list[int]:
        """The token ids of a text prompt, as generate sees them (no special tokens added)."""
        with self._lock:
            return front_end.encode(self.tokenizer, text)

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
        request_ids, box = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm) as bar:
            for out in self._run(request_ids, box):
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
        request_ids, box = self._submit(prompts, sampling_params, stream=True)
        index = {rid: i for i, rid in enumerate(request_ids)}
        reported = set()  # (request, completion) pairs whose end was reported
        for out in self._run(request_ids, box, stream=True):
            for c in out.outputs:
                ended = c.finished and (out.request_id, c.index) not in reported
                if c.delta_token_ids or c.delta_text or ended:
                    if ended:
                        reported.add((out.request_id, c.index))
                    yield {
                        "index": index[out.request_id],
                        "completion": c.index,
                        "text": c.delta_text,
                        "token_ids": c.delta_token_ids,
                        "finished": c.finished,
                        "finish_reason": c.finish_reason,
                    }

    def _run(
        self, request_ids: list[str], box: deque[RequestOutput], stream: bool = False
    ) -> Iterator[RequestOutput]:
        """The one loop: yield these requests' outputs as they come, stepping the engine when none
        is waiting in `box` (another caller's step may have filled it). If the caller stops early
        (an exception, or a stream left unfinished), the rest are aborted."""
        waiting = set(request_ids)
        try:
            while waiting:
                if not box and not self._step() and not box:
                    raise RuntimeError(
                        f"the engine has no work left, but requests {sorted(waiting)} did not finish"
                    )
                while box:
                    out = box.popleft()
                    if out.finished:
                        waiting.discard(out.request_id)
                    yield out
        finally:
            self._leave(request_ids, waiting, stream)

    def _step(self) -> bool:
        """One engine step, its outputs routed to their callers; False if the engine is idle."""
        with self._lock:
            engine = self._engine()
            for rid in self._abandoned:
                engine.abort_request(rid)
            self._abandoned.clear()
            self._stepping = True
            try:
                outputs = engine.step(
                    finished_only=not self._streams
                )  # no text decoded that nobody reads
            finally:
                self._stepping = False
            for out in outputs:
                if out.request_id in self._routes:
                    self._routes[out.request_id].append(out)
            return bool(outputs) or engine.has_unfinished_requests()

    def _leave(self, request_ids: list[str], waiting: set[str], stream: bool) -> None:
        """A caller is done: drop its routes and abort its unfinished requests (their blocks are freed now)."""
        with self._lock:
            for rid in request_ids:
                self._routes.pop(rid, None)
            self._streams -= stream
            if not waiting or self.engine is None:
                return
            if (
                self._stepping
            ):  # a stream collected in the middle of a step (by this thread): the next step aborts
                self._abandoned += waiting
                return
            for rid in waiting:
                self.engine.abort_request(rid)
            if not self._routes:
                self.engine.step()  # hand out (and drop) the aborted requests' last outputs

    # ---- input checks: every problem is reported before any work starts ----

    def _submit(
        self, prompts: list[Prompt], sampling_params, stream: bool = False
    ) -> tuple[list[str], deque[RequestOutput]]:
        """Tokenize and check every prompt with its params (engine/front_end.py), then queue
        them all; returns their request ids and the box their outputs will be routed to."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        params = self._params_per_prompt(sampling_params, len(prompts))
        with self._lock:
            engine = self._engine()
            token_lists = [front_end.tokenize(self.tokenizer, p) for p in prompts]
            front_end.check_requests(token_lists, params, self.config, self.model_config)
            request_ids, box = (
                [engine.enqueue(ids, p) for ids, p in zip(token_lists, params)],
                deque(),
            )
            self._routes |= dict.fromkeys(request_ids, box)
            self._streams += stream
            return request_ids, box

    @staticmethod
    def _params_per_prompt(sampling_params, n: int) -> list:
        """One for all prompts, or one per prompt (validate_request checks that each is a SamplingParams)."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (list, tuple)):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(
                f"got {len(sampling_params)} SamplingParams for {n} prompts; pass one, or one per prompt"
            )
        return list(sampling_params)

    # ---- resources ----

    def shutdown(self) -> None:
        if getattr(self, "engine", None) is not None:
            with self._lock:
                self.engine.shutdown()
                self.engine = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
