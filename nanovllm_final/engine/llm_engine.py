import functools
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from ..config import EngineConfig, check_tensor_parallel
from ..log import log_once
from ..model_config import ModelConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..speculative_config import check_draft
from ..validate import Problem
from .block_manager import BlockManager
from .front_end import token_ids, validate_request
from .metrics import EngineMetrics
from .model_runner import ModelRunner
from .prompt_logprobs import collect_scores
from .prompt_scoring import mark_launched
from .request import Request
from .sampling import PendingSample, SampledTokens, SamplingColumns, build_sampling_batch
from .scheduler import Scheduler
from .sequence import Sequence
from .spec_verify import Verified, verify_batch
from .speculator import Speculator
from .step_input import BlockTables, StepInput, build_step_input
from .structured import Grammars
from .workers import WorkerError, WorkerGroup

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet. It holds them: row i
    of `sample` is the pending token of `sampling[i]`, on the device, where it feeds the
    next step (overlap scheduling) before the host sees it."""

    step: StepInput
    seqs: list[Sequence]  # every sequence the step runs
    sampling: list[Sequence]  # those it samples for, in row order
    sample: PendingSample | None
    record: dict  # its stats record, taken at launch (metrics.py)
    launched_at: float
    # the next schedule needs its tokens on the host (penalties count the output)
    needs_tokens: bool
    # its prompt logprobs (step.scoring's rows), on their way to the host
    scores: PendingSample | None = None
    # some rows sampled under a grammar: the next step's mask needs their tokens
    constrained: bool = False
    # the draw held back while its grammar mask fills beside the step before's completion:
    # (logits, batch), queued by `_draw`
    held: tuple | None = None

    def pending_rows(self) -> dict[int, int]:
        """seq_id -> the row of its pending token."""
        return {seq.seq_id: row for row, seq in enumerate(self.sampling)}


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
    completed before the next one is scheduled; a grammar's mask needs them too, but only
    before the draw (engine/structured.py).

    A step that raises ends its requests with finish_reason "error" (the message in the
    output's `error`) and frees their blocks; the others go on. An error that loses the
    device or the tensor-parallel workers stops the engine: that step raises it, the next
    call hands out an error output for every request, and later calls raise."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer):
        check_tensor_parallel(config, model_config)
        check_draft(config.speculative_config, model_config.vocab_size, tokenizer)
        self.config, self.model_config, self.tokenizer = config, model_config, tokenizer
        self.eos_token_ids = list(model_config.eos_token_ids)  # every one of them ends a sequence
        self.eos_set = set(self.eos_token_ids)
        self.tokenizer_size = len(tokenizer)
        # tensor parallelism: this process is rank 0; ranks 1.. are worker processes
        self.workers = (
            WorkerGroup(config, model_config, ModelRunner)
            if config.tensor_parallel_size > 1
            else None
        )
        if self.workers is None:
            self.model_runner = ModelRunner(config, model_config, rank=0)
        else:
            self.model_runner = self.workers.run_here(
                ModelRunner, config, model_config, 0
            )  # and wait for every worker's
        self.block_manager = BlockManager(
            self.model_runner.num_kvcache_blocks, config.kvcache_block_size
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.metrics = EngineMetrics(self.scheduler, self.block_manager)
        spec = config.speculative_config
        self.speculator = (
            None if spec is None else Speculator(spec, config, self.block_manager.num_blocks)
        )
        self.scheduler.speculator = self.speculator
        self.requests: dict[str, Request] = {}
        self.pending: list[RequestOutput] = []  # outputs not handed out yet (the step returns them)
        self.overlap = config.overlap_scheduling  # taking turns with speculation: speculator.py
        self.in_flight: InFlight | None = None
        self.block_tables = (
            BlockTables()
        )  # the steps' block-table arrays, each built from the one before
        self.sampling_columns = (
            SamplingColumns()
        )  # the sampling rows' parameter columns, kept while the rows stay
        self.grammars = Grammars(
            tokenizer, model_config.vocab_size, self.eos_token_ids
        )  # structured output
        self.grammars.device = self.model_runner.device
        self.last_done: float | None = (
            None  # when the step before completed (the next one's time counts from there)
        )
        self.error: str | None = None  # why the engine stopped, if it did
        self._ids = itertools.count()

    # ---- requests ----

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a prompt; returns its request id. Bad input is a Problem (a ValueError naming
        the field, see validate.py), and nothing is queued."""
        if self.model_runner is None:
            raise RuntimeError("the engine was shut down; create a new LLM")
        prompt_token_ids = token_ids(prompt_token_ids)  # numpy's integers as ints
        problem = validate_request(prompt_token_ids, params, self.config, self.model_config)
        if problem:
            raise problem
        return self.enqueue(prompt_token_ids, params, request_id)

    def enqueue(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """add_request for a prompt that validate_request has passed (the LLM checks a whole
        batch before it queues any of it). An id given must not be in use; an id of None gets
        a fresh one that no live request (nor an abort output not yet handed out) has."""
        if request_id is None:
            while (request_id := str(next(self._ids))) in self.requests or any(
                o.request_id == request_id for o in self.pending
            ):
                pass
        elif not isinstance(request_id, str) or not request_id:
            raise Problem(
                f"request_id must be a non-empty string or None, got {request_id!r}", "request_id"
            )
        elif request_id in self.requests:
            raise Problem(f"request id {request_id!r} is already in use", "request_id")
        else:  # a new request under an aborted one's id: the old abort output is not handed out as the new one's
            self.pending = [o for o in self.pending if o.request_id != request_id]
        resolved = params.resolve(
            self.model_config.generation_defaults, self.model_config.vocab_size
        )
        request = Request(request_id, list(prompt_token_ids), resolved, self.tokenizer)
        if not self.requests and self.speculator is not None:
            self.speculator.idle()  # the first request after a pause
        self.requests[request_id] = request
        if resolved.structured_outputs is not None:
            self.grammars.add(
                request
            )  # scheduled once its grammar has compiled (_admit_structured)
        else:
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
        return len(self.scheduler.waiting) + self.grammars.num_waiting

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks in the pool."""
        return self.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    # ---- the loop ----

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One model step; returns an output for every request that got tokens or finished
        (`finished_only`: for the finished ones only, which spares decoding text nobody reads).
        With overlap, the outputs are those of the step launched by the call before."""
        if self.model_runner is None:
            raise RuntimeError("the engine was shut down; create a new LLM")
        if self.error is not None and not self.pending:
            raise RuntimeError(f"the engine stopped earlier: {self.error}; create a new LLM")
        if self.error is None:
            self._overlapped_step(finished_only) if self.overlap else self._sequential_step(
                finished_only
            )
        outputs, self.pending = self.pending, []
        return outputs

    def _sequential_step(self, finished_only: bool) -> None:
        """Launch a step and complete it."""
        done = self._launch(None)
        if done is not None:
            self._complete(done, finished_only)

    def _overlapped_step(self, finished_only: bool) -> None:
        """Launch step N+1, then complete step N (the one in flight) while the device runs N+1."""
        done, self.in_flight = self.in_flight, None
        if done is not None and done.needs_tokens:  # N+1's schedule needs N's tokens on the host
            self._complete(done, finished_only)
            done = None
        self.in_flight = self._launch(done)
        if done is not None:
            self._complete(done, finished_only)
        self.in_flight = self._draw(self.in_flight)
        if (
            self.in_flight is not None and not self.requests
        ):  # it runs only sequences that have ended
            self._complete(self.in_flight, finished_only)
            self.in_flight = None
        if self.in_flight is None:
            self.last_done = None  # idle: the next step's time counts from its launch

    def _launch(self, prev: InFlight | None) -> InFlight | None:
        """Schedule, build the inputs, queue the model and the sampler on the device. `prev`:
        the step still in flight, whose sampled tokens this one feeds."""
        start = time.perf_counter()
        hits_before = self.block_manager.num_hit_tokens
        if self.grammars.waiting:
            self._admit_structured()
        seqs = self.scheduler.schedule()
        if not seqs:
            if self.grammars.waiting:
                time.sleep(0.001)  # nothing to run but grammars compiling: do not spin
            return None
        try:
            if self.speculator is not None:
                self.speculator.fill(seqs)  # a draft model's proposals
            step = build_step_input(
                seqs,
                self.config.kvcache_block_size,
                prev.pending_rows() if prev is not None else None,
                self.block_tables,
            )
            logits = self._execute(step, prev)
            sampling, batch, pending, constrained = self._queue_sample(prev, seqs, step, logits)
            # under overlap a pool fills the mask while the engine completes `prev`: the draw waits
            held = (logits, batch) if pending is None and batch is not None else None
        except Exception as err:
            self._fail(seqs, err)
            return None
        self.scheduler.launched(seqs)
        mark_launched(step.scoring, seqs)
        record = self.metrics.step_record(
            step, len(seqs), self.block_manager.num_hit_tokens - hits_before
        )
        # penalties count the output; a proposer reads it
        needs_tokens = batch is not None and batch.penalties is not None
        if self.speculator is not None:
            needs_tokens |= self.speculator.needs_tokens
        return InFlight(
            step,
            seqs,
            sampling,
            pending,
            record,
            start,
            needs_tokens,
            self.model_runner.prompt_scores,
            constrained,
            held,
        )

    def _execute(self, step: StepInput, prev: InFlight | None):
        """Queue the model on the device (on every rank, with workers); `prev`'s sampled tokens,
        still there, are fed where the step's inputs carry them. Returns rank 0's logits."""
        execute = functools.partial(
            self.model_runner.execute,
            carried=prev.sample.token_ids if prev is not None and prev.sample is not None else None,
        )
        return (
            execute(step) if self.workers is None else self.workers.call("execute", execute, step)
        )

    def _queue_sample(self, prev: InFlight | None, seqs: list[Sequence], step: StepInput, logits):
        """Queue the draw of the step's sampling rows: (sampling, batch, pending, constrained), the
        sequences it samples for, their batch, the queued draw, and whether some row samples under
        a grammar."""
        all_sample = len(step.sample_rows) == len(seqs)  # most steps: every sequence samples
        sampling = seqs if all_sample else [seq for seq in seqs if seq.samples_this_step]
        batch = pending = None
        constrained = False  # some row samples under a grammar
        if self.speculator is not None and self.speculator.drafted(sampling):
            batch = verify_batch(sampling, self.eos_token_ids, self.sampling_columns)
        elif sampling:
            batch = build_sampling_batch(sampling, self.eos_token_ids, self.sampling_columns)
            constrained = self.grammars.used and any(seq.grammar is not None for seq in sampling)
            if constrained:
                batch.grammar = self._mask(prev, sampling)
        filling = batch is not None and batch.grammar is not None and batch.grammar.pending
        if batch is not None and not (filling and prev is not None):
            pending = self.model_runner.sample(logits, batch)
        return sampling, batch, pending, constrained

    def _mask(self, prev: InFlight | None, sampling: list[Sequence]):
        """The grammar mask of a step with constrained rows (structured.py), filled on the host
        while the device runs the step's forward pass. Under overlap the step before's tokens go
        into the matchers first, and a large batch's rows fill on the grammars' threads while
        the engine's thread completes that step (`_draw` queues the draw after it); sequentially
        they went in as that step completed."""
        ended = frozenset()  # the rows whose grammar ended on the step before's token
        if prev is not None and prev.constrained:
            ended = self.grammars.advance(prev.sampling, prev.sample.result().token_ids)
        return self.grammars.bitmask(sampling, ended)

    def _draw(self, flight: InFlight | None) -> InFlight | None:
        """Queue the draw that `flight` held back for its grammar mask (the mask waited for);
        None if the draw fails (its requests end with the error)."""
        if flight is None or flight.held is None:
            return flight
        (logits, batch), flight.held = flight.held, None
        try:
            flight.sample = self.model_runner.sample(logits, batch)
        except Exception as err:
            self._fail(flight.seqs, err)
            return None
        return flight

    def _complete(self, done: InFlight, finished_only: bool) -> None:
        """Wait for the step's tokens; resolve, detokenize, check stops, queue the outputs."""
        try:
            sampling, sampled = self._read_tokens(done)
            now = time.perf_counter()
            self._warn_past_tokenizer(sampled)
            news, ended = self._resolve(sampling, sampled, now)
            finished = [
                request
                for request_id, request in news.items()
                if request_id in ended and request.finished
            ]
            outputs = [
                request.output() for request in (finished if finished_only else news.values())
            ]
        except Exception as err:
            self._fail(done.seqs, err)
            return
        self.pending += outputs
        for request in finished:
            del self.requests[request.request_id]
            self.metrics.on_finish(request)
        end = time.perf_counter()
        self.metrics.on_step(done.record, end - max(done.launched_at, self.last_done or 0.0))
        self.last_done = end

    def _read_tokens(self, done: InFlight) -> tuple[list[Sequence], SampledTokens | Verified]:
        """(sampling, sampled): the step's tokens on the host, and the sequence of each row."""
        if done.scores is not None:
            collect_scores(done.step.scoring, done.scores, done.seqs, self.requests)
        # a step with no row sampled: an empty result
        sampled = done.sample.result() if done.sample is not None else SampledTokens([], None)
        sampling = done.sampling
        # a row per emitted token, several per verifying sequence
        if isinstance(sampled, Verified):
            if self.speculator.accept(sampled, sampling, self.block_manager):
                # a block table shrank: the next step's are written whole
                self.block_tables = BlockTables()
            sampling = sampled.seqs
        return sampling, sampled

    def _warn_past_tokenizer(self, sampled: SampledTokens | Verified) -> None:
        if max(sampled.token_ids, default=0) >= self.tokenizer_size:
            log_once(
                logger,
                logging.WARNING,
                (
                    f"sampled a token id of {self.tokenizer_size} or more, but the tokenizer has only {self.tokenizer_size} tokens: "
                    "such ids decode to no text (is this a random-weight model whose vocab_size exceeds its tokenizer?)"
                ),
            )

    def _resolve(
        self, sampling: list[Sequence], sampled: SampledTokens | Verified, now: float
    ) -> tuple[dict[str, Request], set[str]]:
        """Give each sequence its token and check its stops: (news, ended), the requests that got
        tokens, and those a sequence of which ended here (only they may have finished)."""
        news: dict[str, Request] = {}
        ended: set[str] = set()
        # a row of every sequence the step sampled for (this loop runs for each, every step)
        requests, resolve, eos, max_len = (
            self.requests,
            self.scheduler.resolve,
            self.eos_set,
            self.config.max_model_len,
        )
        for seq, token_id, logprob in zip(
            sampling, sampled.token_ids, sampled.logprobs or itertools.repeat(None)
        ):
            if seq.is_finished:
                continue  # aborted, or stopped by the token of the step before
            resolve(seq, token_id)
            request = requests[seq.request_id]
            reason = request.on_token(seq, token_id, logprob, now, eos, max_len)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                ended.add(request.request_id)
            news[request.request_id] = request
        return news, ended

    def _admit_structured(self) -> None:
        """Schedule the requests whose grammar has compiled; end those whose grammar failed."""
        ready, failed = self.grammars.poll()
        for request in ready:
            for seq in request.seqs:
                self.scheduler.add(seq)
        for request, message in failed:
            del self.requests[request.request_id]
            for seq in request.seqs:
                self.scheduler.finish(seq, "error")
            self.pending.append(self._error_output(request, message))
            self.metrics.on_finish(request)

    # ---- a step that failed ----

    def _fail(self, seqs: list[Sequence], err: Exception) -> None:
        """End the requests of a failed step with finish_reason "error" and free their blocks;
        if the error lost the device or the workers, end every request, stop the engine and
        raise the error."""
        fatal = isinstance(err, (WorkerError, torch.AcceleratorError)) or (
            self.workers is not None and not self.workers.alive
        )
        message = f"{type(err).__name__}: {err}"
        if fatal:
            self.error, self.in_flight = message, None
        else:
            logger.error("a step failed, its requests end with an error: %s", message, exc_info=err)
        for request_id in (
            list(self.requests) if fatal else dict.fromkeys(seq.request_id for seq in seqs)
        ):
            request = self.requests.pop(request_id, None)
            if request is None:
                continue  # ended already
            for seq in request.seqs:
                self.scheduler.finish(seq, "error")
            self.pending.append(self._error_output(request, message))
            self.metrics.on_finish(request)
        if fatal:
            raise err

    @staticmethod
    def _error_output(request: Request, message: str) -> RequestOutput:
        out = request.output()  # its new tokens only: no text is decoded here
        out.error = message
        return out

    # ---- measurements ----

    @property
    def stats(self) -> list[dict]:
        """One record per step (metrics.py)."""
        return self.metrics.stats

    def metrics_summary(self) -> dict:
        """Requests, tokens, throughput, latency percentiles, prefix-cache hit rate, KV usage, preemptions."""
        summary = self.metrics.summary()
        return summary if self.speculator is None else summary | self.speculator.summary()

    def reset_metrics(self) -> None:
        """Forget what was measured so far (e.g. after a warm-up)."""
        self.metrics.reset()
        if self.speculator is not None:
            self.speculator.reset()

    def shutdown(self) -> None:
        """Free the model, the KV cache and the workers; later calls do nothing, and step() or
        add_request() after it raise."""
        if self.model_runner is None:
            return
        self.grammars.shutdown()
        if self.workers is not None:
            self.workers.shutdown()
        self.model_runner.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()
        self.model_runner = None
