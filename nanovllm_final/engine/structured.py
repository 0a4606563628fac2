"""Structured output in the engine, on xgrammar (the optional extra `structured`):

    grammars = Grammars(tokenizer, vocab_size, eos_token_ids)
    grammars.add(request)                  # its grammar compiles on a worker thread (cached by schema)
    ready, failed = grammars.poll()        # each step: requests whose grammar is ready (their
                                           #   sequences get a matcher each), or failed / timed out
    mask = grammars.bitmask(seqs)          # the step's constrained rows, their allowed tokens (host)
    logits = apply_bitmask(logits, *mask.to(device))  # on the device: the other tokens at -inf

A request waits here, outside the scheduler, until its grammar is ready; the others run on.
Each sequence's matcher accepts its tokens as they resolve (Request.on_token): EOS is allowed
only where the grammar can end.

Overlap scheduling: step N+1's mask needs step N's tokens. So the engine queues N+1's forward
pass (fed N's tokens on the device), waits for N's tokens, advances the matchers with them
(`advance`; N's tokens resolve later, and the matchers do not take them twice), and fills N+1's
mask while the device runs that forward pass. On a GPU a large batch's rows fill on a FillPool's
threads while the engine's thread completes step N (xgrammar's fill lets go of the GIL), and
N+1's draw is queued after that; a mask filled on the engine's thread is drawn at once."""

import atexit
import copy
import functools
import json
import os
import queue
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np
import torch

from ..kernels import dispatch
from ..structured_outputs import StructuredOutputsParams, subschemas
from ..validate import Problem
from .step_input import unpack, upload

try:
    from ..kernels.grammar_mask import mask_logits_
except ImportError:  # no Triton: the PyTorch code masks
    mask_logits_ = None

COMPILE_TIMEOUT_S = 10.0  # a grammar still compiling after this long ends its request with an error
CACHE_SIZE = 256  # compiled grammars kept (by schema)
FILL_THREADS_ENV = "NANOVLLM_FILL_THREADS"  # the FillPool's threads on a GPU (0: none)
# a step with at most this many constrained rows fills them on the engine's thread at once: a row
# fills in microseconds, and handing a few rows to the pool costs more than filling them
FILL_INLINE_ROWS = 16
MISSING_EXTRA = (
    "structured output needs the grammar engine xgrammar: pip install 'nanovllm-staged[structured]'"
)


def fill_threads_setting() -> int:
    """The threads that fill a step's bitmask beside the engine's thread on a GPU:
    NANOVLLM_FILL_THREADS, else a quarter of the cores (1 to 4); 0 fills every mask on the
    engine's thread."""
    text = os.environ.get(FILL_THREADS_ENV)
    if text is None:
        return max(1, min(4, (os.cpu_count() or 2) // 4))
    if not text.strip().isdigit():
        raise ValueError(f"{FILL_THREADS_ENV} must be a number of threads (0: none), not {text!r}")
    return int(text)


@functools.cache
def xgrammar():
    """The xgrammar module, or None if the extra is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    return xgr


def check_available() -> Problem | None:
    """The problem with serving a structured-output request here (the extra missing), or None."""
    return (
        None
        if xgrammar() is not None
        else Problem(MISSING_EXTRA, "structured_outputs", "unsupported")
    )


def clean_error(err: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /project/cpp/x.cc:12: Check failed: ...")."""
    text = re.sub(r"\[[\d:]+\] \S+\.cc:\d+: ", "", str(err)).strip()
    return re.sub(r"Check failed: \(.*?\) is false: ", "", text).splitlines()[0][:500]


def bounded_strings(schema: dict) -> dict:
    """A copy of `schema` whose strings bounded by minLength/maxLength alone carry the bounds as a
    pattern of plain characters: xgrammar's length-bounded strings admit raw control characters,
    which JSON parsers refuse (such strings hold no escapes then)."""
    schema = copy.deepcopy(schema)
    for sub, _, _ in subschemas(schema):
        if (
            sub.get("type") == "string"
            and ("minLength" in sub or "maxLength" in sub)
            and "pattern" not in sub
            and "format" not in sub
            and "enum" not in sub
            and "const" not in sub
        ):
            low, high = sub.pop("minLength", 0), sub.pop("maxLength", "")
            sub["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return schema


class Job:
    """One grammar's compile: pending, then a CompiledGrammar or an error message."""

    def __init__(self):
        self.started: float | None = (
            None  # when a worker took it (the time limit counts from there)
        )
        self.future: Future | None = None
        self.error: str | None = None

    def result(self, timeout_s: float):
        """The compiled grammar, None while it compiles, or a ValueError with the reason."""
        if self.error is None and self.future.done():
            err = self.future.exception()
            if err is None:
                return self.future.result()
            self.error = f"the grammar does not compile: {clean_error(err)}"
        elif (
            self.error is None
            and self.started is not None
            and time.perf_counter() - self.started > timeout_s
        ):
            self.error = f"the grammar took more than {timeout_s:g} s to compile (the time limit)"
        if self.error is not None:
            raise ValueError(self.error)
        return None


class Grammars:
    """The engine's structured-output state: grammars compiling or cached, requests waiting for
    theirs, and the step's token bitmask. xgrammar is loaded on the first request that needs it."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        timeout_s: float = COMPILE_TIMEOUT_S,
    ):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.stop_ids = frozenset(eos_token_ids)  # the matchers' stop tokens
        self.timeout_s = timeout_s
        self.compiler = None
        self.threads = fill_threads_setting()
        self.pool: FillPool | None = None  # its threads fill the rows of a large step's bitmask
        self.filler = None  # xgrammar's BatchGrammarMatcher: the rows on the engine's thread
        self.queue: queue.SimpleQueue = queue.SimpleQueue()  # (job, params), for the workers
        self.workers: list[threading.Thread] = []  # two: one slow grammar leaves the other free
        self.cache: OrderedDict[tuple[str, str], Job] = OrderedDict()
        self.waiting: list[tuple] = []  # (Request, Job)
        self.used = False  # no structured request yet: steps skip the bitmask entirely
        self.device: torch.device | None = (
            None  # a GPU: the masks go there, filled in pinned memory
        )

    def _compiler(self):
        if self.compiler is None:
            xgr = xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.grammar_vocab, stop_token_ids=self.eos_token_ids
            )
            self.compiler = xgr.GrammarCompiler(
                info, max_threads=1, cache_enabled=False
            )  # cached here, by key
        return self.compiler

    @property
    def grammar_vocab(self) -> int:
        """The token ids a grammar may allow: the tokenizer's (and the EOS ids), at most the model's
        vocab_size. The ids past them decode to no text: apply_bitmask masks them without a bit, and
        the matchers skip them (xgrammar checks a token against its special ids one by one: 151k of
        them, 60 us a token, where a random-weight model's vocab_size far exceeds its tokenizer)."""
        return min(
            self.vocab_size, max(len(self.tokenizer), max(self.eos_token_ids, default=0) + 1)
        )

    def _compile(self, job: Job, params: StructuredOutputsParams):
        job.started = time.perf_counter()
        compiler, kind, value = self._compiler(), params.kind, getattr(params, params.kind)
        if kind == "json":
            return compiler.compile_json_schema(
                json.dumps(bounded_strings(value)), any_whitespace=False
            )
        if (
            kind == "json_object"
        ):  # an object (xgrammar's builtin JSON grammar takes any value), compact
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "choice":
            return compiler.compile_regex("|".join(re.escape(c) for c in value))
        return compiler.compile_grammar(value)

    def submit(self, params: StructuredOutputsParams) -> Job:
        """The compile job of `params`' grammar: the cached one, or a new one on a worker."""
        key = params.key
        job = self.cache.get(key)
        if job is not None:
            self.cache.move_to_end(key)
            return job
        job = self.cache[key] = Job()
        job.future = Future()
        self.queue.put((job, params))
        if (
            not self.workers
        ):  # daemon threads: a compile past its time limit cannot hold up the process's exit
            self.workers = [
                threading.Thread(target=self._work, name=f"grammar-{i}", daemon=True)
                for i in range(2)
            ]
            for worker in self.workers:
                worker.start()
            LIVE.add(self)
        if len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        return job

    def add(self, request) -> None:
        self.used = True
        self.waiting.append((request, self.submit(request.params.structured_outputs)))

    @property
    def num_waiting(self) -> int:
        return sum(len(request.seqs) for request, _ in self.waiting)

    def poll(self) -> tuple[list, list[tuple]]:
        """Requests whose grammar is ready (each sequence given a matcher), and those whose grammar
        failed or timed out, with the reason; the rest keep waiting. Ended requests are dropped."""
        ready, failed, still = [], [], []
        for request, job in self.waiting:
            if request.finished:
                continue  # aborted while it waited
            try:
                compiled = job.result(self.timeout_s)
            except ValueError as err:
                failed.append((request, str(err)))
                continue
            if compiled is None:
                still.append((request, job))
                continue
            for seq in request.seqs:
                seq.grammar = xgrammar().GrammarMatcher(compiled)
            ready.append(request)
        self.waiting = still
        return ready, failed

    def bitmask(self, seqs: list, ended: frozenset[int] = frozenset()) -> "HostMask | None":
        """The rows of `seqs` that have a matcher and their allowed tokens (HostMask), in one host
        buffer (pinned on a GPU, for one copy to the device); None if no row has one. More than
        FILL_INLINE_ROWS rows on a GPU are still filling on the pool's threads when this returns: the
        mask's `wait()` (which `to()` calls) waits for them. `ended`: the seq_ids whose matcher
        `advance` ended (none other is here: a sequence whose grammar ends as its token resolves
        is finished), whose steps run in vain."""
        rows = [
            i for i, seq in enumerate(seqs) if seq.grammar is not None and seq.seq_id not in ended
        ]
        if not rows:
            return None
        pin = self.device is not None and self.device.type == "cuda"
        mask = HostMask.allocate(len(rows), -(-self.grammar_vocab // 32), pin)
        mask.rows[:] = rows
        mask.tail_bits = self.grammar_vocab % 32
        matchers = [seqs[i].grammar for i in rows]
        if len(matchers) > FILL_INLINE_ROWS and self.fill_threads:
            if self.pool is None:
                self.pool = FillPool(self.fill_threads)
            mask.pending = self.pool.fill(matchers, mask.filled)
        elif len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask.filled, 0)
        else:
            if self.filler is None:
                self.filler = xgrammar().BatchGrammarMatcher(max_threads=1)
            self.filler.batch_fill_next_token_bitmask(matchers, mask.filled)
        return mask

    @property
    def fill_threads(self) -> int:
        """The FillPool's threads (fill_threads_setting) on a GPU; none on a CPU, whose forward
        pass keeps every core busy (a thread handed the fill would wait for one)."""
        return self.threads if self.device is not None and self.device.type == "cuda" else 0

    def advance(self, seqs: list, token_ids: list[int]) -> frozenset[int]:
        """Overlap: the step before's tokens, accepted by the matchers before they resolve, so that
        this step's mask can be filled while the device runs its forward pass. Returns the seq_ids
        whose grammar ended (a matcher ends only by accepting a stop token: the EOS ids)."""
        ended, stops = [], self.stop_ids
        for seq, token_id in zip(seqs, token_ids):
            if seq.grammar is not None and not seq.is_finished:
                seq.grammar_early = ok = seq.grammar.accept_token(token_id)
                if ok and token_id in stops and seq.grammar.is_terminated():
                    ended.append(seq.seq_id)
        return frozenset(ended)

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            job, params = item
            try:
                job.future.set_result(self._compile(job, params))
            except Exception as err:  # noqa: BLE001 - the compiler's refusal is the request's error
                job.future.set_exception(err)

    def shutdown(self) -> None:
        for _ in self.workers:
            self.queue.put(None)  # each stops after its compile
        self.workers = [worker for worker in self.workers if worker.is_alive()]
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


class FillPool:
    """Threads that fill a step's bitmask, a chunk of rows each, while the engine's thread goes on:
    xgrammar's fill lets go of the GIL. `fill` returns once every chunk's thread has taken its
    chunk: a thread that wakes while the engine's thread runs Python would wait for the GIL (up to
    Python's switch interval, 5 ms) before it could start."""

    def __init__(self, threads: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # (matchers, bitmask rows, Future)
        self.taken = threading.Semaphore(0)
        self.threads = [
            threading.Thread(target=self._work, name=f"grammar-fill-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self.threads:
            thread.start()

    def fill(self, matchers: list, bitmask: torch.Tensor) -> list[Future]:
        """Fill `bitmask` (rows, words) int32, row i from matchers[i], in up to one chunk per
        thread: the chunks' futures."""
        chunks = min(len(self.threads), -(-len(matchers) // FILL_INLINE_ROWS))
        size = -(-len(matchers) // chunks)
        futures = []
        for start in range(0, len(matchers), size):
            futures.append(Future())
            self.jobs.put(
                (matchers[start : start + size], bitmask[start : start + size], futures[-1])
            )
        for _ in futures:
            self.taken.acquire()
        return futures

    def _work(self) -> None:
        filler = xgrammar().BatchGrammarMatcher(max_threads=1)
        while (job := self.jobs.get()) is not None:
            matchers, bitmask, future = job
            self.taken.release()
            try:
                filler.batch_fill_next_token_bitmask(matchers, bitmask)
                future.set_result(None)
            except Exception as err:  # noqa: BLE001 - the step that waits for the mask raises it
                future.set_exception(err)

    def shutdown(self) -> None:
        for _ in self.threads:
            self.jobs.put(None)


class HostMask:
    """A step's grammar mask on the host: the constrained rows (c,) int64 and their allowed tokens,
    an int32 bitmask (c, words) (bit j of word w: token 32 w + j), in one buffer: pinned, it goes
    to the device in one copy that the host does not wait for."""

    def __init__(self, packed: torch.Tensor, num_rows: int, words: int, offset: int, pinned: bool):
        self.packed, self.offset, self.pinned = (
            packed,
            offset,
            pinned,
        )  # (bytes,) uint8: rows, then bitmask at offset
        self.pending: list[Future] = []  # the chunks still filling on a FillPool
        self.tail_bits = 0  # the grammar's ids in the last word (0: all 32)
        self.rows = packed[: 8 * num_rows].numpy().view(np.int64)  # (c,)
        # (c, words) int32, as xgrammar fills it
        self.filled = (
            packed[offset : offset + 4 * num_rows * words].view(torch.int32).view(num_rows, words)
        )
        self.bitmask = self.filled.numpy()  # (c, words), the same memory

    @classmethod
    def allocate(cls, num_rows: int, words: int, pin: bool) -> "HostMask":
        offset = -(-8 * num_rows // 16) * 16  # the bitmask's, 16-byte aligned
        size = (
            offset + -(-4 * num_rows * words // 16) * 16
        )  # viewed whole as int64 and int32 (unpack)
        packed = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        return cls(packed, num_rows, words, offset, pin)

    def wait(self) -> "HostMask":
        """The mask, every row filled (a chunk's error raised here), the last word's bits past
        the grammar's ids cleared."""
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()
        if self.tail_bits:  # the last word's bits past the grammar's ids: no token of the grammar's
            self.bitmask[:, -1] &= np.int32((1 << self.tail_bits) - 1)
            self.tail_bits = 0
        return self

    def to(self, device: torch.device) -> list[torch.Tensor]:
        """[rows, bitmask] on the device, once filled."""
        self.wait()
        if not self.pinned or device.type != "cuda":
            return upload([self.rows, self.bitmask], device)
        return unpack(
            self.packed.to(device, non_blocking=True), [self.rows, self.bitmask], [0, self.offset]
        )


LIVE: weakref.WeakSet = weakref.WeakSet()  # every Grammars that started workers


@atexit.register
def _finish_compiles() -> None:
    """At exit, the compiles still running finish first (up to the time limit): a worker inside the
    compiler while the interpreter tears down crashes the process (SIGSEGV or abort)."""
    workers = []
    for grammars in list(LIVE):
        grammars.shutdown()
        workers += grammars.workers
    deadline = time.perf_counter() + COMPILE_TIMEOUT_S
    for worker in workers:
        worker.join(max(0.0, deadline - time.perf_counter()))


def accepts(seq, token_id: int, stop_ids: set[int]) -> bool:
    """Advance the sequence's matcher by its token as it resolves (unless `advance` did already);
    False: the grammar has ended (a stop token of `stop_ids` accepted) or refused the token."""
    ok = seq.grammar.accept_token(token_id) if seq.grammar_early is None else seq.grammar_early
    seq.grammar_early = None
    return ok and not (token_id in stop_ids and seq.grammar.is_terminated())


def apply_bitmask(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, inplace: bool = False
) -> torch.Tensor:
    """`logits` (rows_all, vocab) whose `rows` (c,) keep only the tokens set in `bitmask` (c, words)
    int32 (bit j of word w: token 32 w + j; the tokens past 32 words are not allowed); the others
    become -inf. Every draw after this (argmax, top-k candidates, softmax) then picks an allowed
    token. On CUDA one kernel masks them (in place where `inplace`, else in a copy)."""
    if mask_logits_ is not None and dispatch.use_kernel(logits):
        return mask_logits_(logits if inplace else logits.clone(), rows, bitmask)
    return apply_bitmask_reference(logits, rows, bitmask)


def apply_bitmask_reference(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> torch.Tensor:
    """apply_bitmask in PyTorch, in a copy: the bits unpacked into a (c, words, 32) temporary."""
    width = min(logits.shape[1], 32 * bitmask.shape[1])
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :width].bool()  # (c, width)
    masked = torch.full(
        (len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device
    )
    masked[:, :width] = logits[rows, :width].masked_fill(~allowed, float("-inf"))  # (c, vocab)
    return logits.index_put((rows,), masked)
