import itertools
import logging
import time
from dataclasses import dataclass

from ..config import EngineConfig, ModelConfig, check_tensor_parallel
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..validate import Problem, validate_request
from .block_manager import BlockManager
from .metrics import EngineMetrics
from .model_runner import ModelRunner, PendingSample
from .request import Request
from .sampling_batch import build_sampling_batch
from .scheduler import Scheduler
from .sequence import Sequence
from .step_input import StepInput, build_step_input
from .workers import WorkerGroup

logger = logging.getLogger(__name__)
_warned_vocab = False


@dataclass
class InFlight:
    """A step launched on the device whose sampled tokens the host has not seen yet."""

    step: StepInput
    sampling: list[Sequence]  # in row order
    sample: PendingSample | None
    record: dict  # its stats record, taken at launch (metrics.py)
    launched_at: float
    needs_tokens: bool  # the next schedule needs its tokens on the host (penalties count the output)


class LLMEngine:
    """Requests in, outputs out, one model step at a time:

        rid = engine.add_request(prompt_token_ids, params)
        while engine.has_unfinished_requests():
            for out in engine.step(): ...   # a RequestOutput per request with news

    A step schedules sequences, runs the model once on every rank, samples on rank 0,
    appends the tokens, detokenizes, and ends the sequences that stop.

    Overlap scheduling (`overlap_scheduling`, on by default on CUDA): the device runs
    step N+1 while the host finishes step N. `step()` schedules and launches N+1 first,
    feeding each sequence the token N sampled straight from the device, and only then
    waits for N's tokens and processes them; so the host's scheduling, input building,
    detokenizing and stop checks hide behind the GPU's work instead of adding to it. A
    sequence that stops at step N has run step N+1 in vain (its result is dropped).
    Penalties need the output tokens on the host, so a step that applies them is
    completed before the next one is scheduled."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer):
        check_tensor_parallel(config, model_config)
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.eos_token_ids = list(model_config.eos_token_ids)  # every one of them ends a sequence
        self.eos_set = set(self.eos_token_ids)
        self.tokenizer_size = len(tokenizer)
        # tensor parallelism: this process is rank 0; ranks 1.. are worker processes
        self.workers = WorkerGroup(config, model_config, ModelRunner) if config.tensor_parallel_size > 1 else None
        if self.workers is None:
            self.model_runner = ModelRunner(config, model_config, rank=0)
        else:
            self.model_runner = self.workers.run_here(ModelRunner, config, model_config, 0)  # and wait for every worker's
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.metrics = EngineMetrics(self.scheduler, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.pending: list[RequestOutput] = []  # outputs of aborted requests, handed out by the next step
        self.overlap = config.overlap_scheduling
        self.in_flight: InFlight | None = None
        self.last_done: float | None = None  # when the step before completed (the next one's time counts from there)
        self._ids = itertools.count()

    # ---- requests ----

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a prompt; returns its request id. Bad input is a Problem (a ValueError naming
        the field, see validate.py), and nothing is queued."""
        problem = validate_request(prompt_token_ids, params, self.config, self.model_config)
        if problem:
            raise problem
        return self.enqueue(prompt_token_ids, params, request_id)

    def enqueue(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """add_request for a prompt that validate_request has passed (the LLM checks a whole
        batch before it queues any of it). An id given must not be in use; an id of None gets
        a fresh one that no live request (nor an abort output not yet handed out) has."""
        if request_id is None:
            while (request_id := str(next(self._ids))) in self.requests or any(o.request_id == request_id for o in self.pending):
                pass
        elif not isinstance(request_id, str) or not request_id:
            raise Problem(f"request_id must be a non-empty string or None, got {request_id!r}", "request_id")
        elif request_id in self.requests:
            raise Problem(f"request id {request_id!r} is already in use", "request_id")
        else:  # a new request under an aborted one's id: the old abort output is not handed out as the new one's
            self.pending = [o for o in self.pending if o.request_id != request_id]
        resolved = params.resolve(self.model_config.generation_defaults, self.model_config.vocab_size)
        request = Request(request_id, list(prompt_token_ids), resolved, self.tokenizer)
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        self.metrics.on_arrival()
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (between steps): its blocks are freed, and the next step hands out
        its last output, with finish_reason "abort". Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self.pending.append(request.output())
        self.metrics.on_finish(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.pending)

    @property
    def num_running(self) -> int:
        """Sequences holding KV blocks (a request with n completions counts n)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the loop ----

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One model step; returns an output for every request that got tokens or finished
        (`finished_only`: for the finished ones only, which spares decoding text nobody reads).
        With overlap, the outputs are those of the step launched by the call before."""
        outputs, self.pending = self.pending, []
        done = self.in_flight
        if done is not None and (not self.overlap or done.needs_tokens):
            outputs += self._complete(done, finished_only)
            done = None
        self.in_flight = self._launch()
        if done is not None:  # while the device runs the step just launched
            outputs += self._complete(done, finished_only)
        # without overlap, or when it only runs sequences that have ended: complete it now
        if self.in_flight is not None and (not self.overlap or not self.requests):
            outputs += self._complete(self.in_flight, finished_only)
            self.in_flight = None
        if self.in_flight is None:
            self.last_done = None  # idle: the next step's time counts from its launch
        return outputs

    def _launch(self) -> InFlight | None:
        """Schedule, build the inputs, queue the model and the sampler on the device."""
        start = time.perf_counter()
        hits_before = self.block_manager.num_hit_tokens
        seqs = self.scheduler.schedule()
        if not seqs:
            return None
        step = build_step_input(seqs, self.config.kvcache_block_size)
        logits = self.model_runner.execute(step) if self.workers is None else self.workers.call("execute", self.model_runner.execute, step)
        sampling = [seq for seq in seqs if seq.samples_this_step]
        sample = self.model_runner.sample(logits, build_sampling_batch(sampling, self.eos_token_ids)) if sampling else None
        self.scheduler.launched(seqs)
        record = self.metrics.step_record(step, len(seqs), self.block_manager.num_hit_tokens - hits_before)
        needs_tokens = any(seq.params.has_penalties for seq in sampling)
        return InFlight(step, sampling, sample, record, start, needs_tokens)

    def _complete(self, done: InFlight, finished_only: bool) -> list[RequestOutput]:
        """Wait for the step's tokens; resolve, detokenize, check stops, hand out outputs."""
        sampled = done.sample.result() if done.sample is not None else None
        now = time.perf_counter()
        news: dict[str, Request] = {}
        for row, seq in enumerate(done.sampling):
            if seq.is_finished:
                continue  # aborted, or stopped by the token of the step before
            token_id = sampled.token_ids[row]
            self.scheduler.resolve(seq, token_id)
            request = self.requests[seq.request_id]
            self._check_vocab(token_id)
            logprob = sampled.logprobs[row] if sampled.logprobs else None
            reason = request.on_token(seq, token_id, logprob, now, self.eos_set, self.config.max_model_len)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            news[request.request_id] = request
        outputs = []
        for request in news.values():
            if request.finished or not finished_only:
                outputs.append(request.output())
            if request.finished:
                del self.requests[request.request_id]
                self.metrics.on_finish(request)
        end = time.perf_counter()
        self.metrics.on_step(done.record, end - max(done.launched_at, self.last_done or 0.0))
        self.last_done = end
        return outputs

    def _check_vocab(self, token_id: int) -> None:
        global _warned_vocab
        if token_id >= self.tokenizer_size and not _warned_vocab:
            _warned_vocab = True  # once per process, not once per engine
            logger.warning(
                "sampled token id %d, but the tokenizer has only %d tokens: such ids decode to no text "
                "(is this a random-weight model whose vocab_size exceeds its tokenizer?)", token_id, self.tokenizer_size,
            )

    @property
    def stats(self) -> list[dict]:
        return self.metrics.stats

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
        self.model_runner.shutdown()
