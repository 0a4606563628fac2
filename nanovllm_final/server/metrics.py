"""GET /metrics: the Prometheus text format (version 0.0.4), written out by hand.

Counters and histograms are kept here, updated by the API process as requests
finish; gauges (queues, KV cache, prefix hits, preemptions) are read from the engine
when /metrics is scraped. The format is simple enough that the server needs no
Prometheus library; the tests parse the output with prometheus_client's parser."""

import bisect
import math
import threading

PREFIX = "nanovllm_"
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Verifications of a sequence with proposals (speculative decoding).",
    "spec_decode_num_draft_tokens": "Tokens proposed (speculative decoding).",
    "spec_decode_num_accepted_tokens": "Proposed tokens accepted (speculative decoding).",
}
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# (name, type, help, key in engine_gauges()'s dict)
ENGINE_FAMILIES = (
    ("num_requests_running", "gauge", "Requests in the engine's running batch.", "running"),
    ("num_requests_waiting", "gauge", "Requests waiting in the engine for admission.", "waiting"),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).", "kv_usage"),
    ("kv_cache_blocks_used", "gauge", "KV-cache blocks in use.", "blocks_used"),
    ("kv_cache_blocks_total", "gauge", "KV-cache blocks in the pool.", "blocks_total"),
    (
        "prefix_cache_hit_rate",
        "gauge",
        "Fraction of prompt tokens served from the prefix cache so far.",
        "prefix_hit_rate",
    ),
    (
        "num_preemptions_total",
        "counter",
        "Sequences preempted (recomputed later) for lack of KV blocks.",
        "preemptions",
    ),
)
# (name, type, help, key in the server's dict)
SERVER_FAMILIES = (
    (
        "server_requests_in_flight",
        "gauge",
        "Requests accepted by the server and not finished yet.",
        "in_flight",
    ),
    (
        "server_max_pending_requests",
        "gauge",
        "Requests in flight past which new ones get HTTP 503.",
        "max_pending",
    ),
    (
        "engine_healthy",
        "gauge",
        "1 while the engine runs, 0 after it failed or stopped.",
        "healthy",
    ),
)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            total += count
            out.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {total}')
        out += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {total}"]
        return out


class ServerMetrics:
    """What the server counts itself; thread-safe (the engine reader thread writes, handlers read)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished_by_reason: dict[str, int] = {}
        self.rejected_by_reason: dict[str, int] = {}
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival in the engine to the first generated token.",
            TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between two generated tokens of a request.",
            TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from submission to the last token, per request.",
            E2E_BUCKETS,
        )

    def prompt(self, num_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_tokens

    def generated(self, num_tokens: int) -> None:
        with self._lock:
            self.generation_tokens += num_tokens

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def observe_request(self, reasons: list[str | None], metrics: dict, e2e_s: float) -> None:
        """A finished request: its completions' finish reasons and the engine's RequestMetrics (as a dict)."""
        self.finished(next((r for r in reasons if r), "unknown"))
        with self._lock:
            if metrics.get("ttft_s") is not None:
                self.ttft.observe(metrics["ttft_s"])
            if metrics.get("tpot_s") is not None:
                self.tpot.observe(metrics["tpot_s"])
            self.e2e.observe(e2e_s)

    def render(self, engine: dict | None, server: dict) -> str:
        """The whole exposition: `engine` from engine_gauges() (None if the engine is down)."""
        lines = _engine_lines(engine) if engine is not None else []
        server = {**server, "healthy": 1 if server["healthy"] else 0}
        for name, kind, help, key in SERVER_FAMILIES:
            lines += _family(name, kind, help, [({}, server[key])])
        with self._lock:
            lines += self._counter_lines()
            for hist in (self.ttft, self.tpot, self.e2e):
                lines.extend(hist.lines())
        return "\n".join(lines) + "\n"

    def _counter_lines(self) -> list[str]:
        """What the server counts itself (under the lock)."""
        finished = sorted(self.finished_by_reason.items())
        rejected = sorted(self.rejected_by_reason.items())
        return [
            *_family(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens submitted to the engine.",
                [({}, self.prompt_tokens)],
            ),
            *_family(
                "generation_tokens_total",
                "counter",
                "Tokens generated.",
                [({}, self.generation_tokens)],
            ),
            *_family(
                "request_success_total",
                "counter",
                "Finished requests, by finish reason (abort: cancelled).",
                [({"finished_reason": r}, n) for r, n in finished],
            ),
            *_family(
                "requests_rejected_total",
                "counter",
                "Requests refused before reaching the engine, by reason.",
                [({"reason": r}, n) for r, n in rejected],
            ),
        ]


def _engine_lines(engine: dict) -> list[str]:
    """The engine's gauges and counters, and speculative decoding's under vLLM's names."""
    lines: list[str] = []
    for name, kind, help, key in ENGINE_FAMILIES:
        lines += _family(name, kind, help, [({}, engine[key])])
    if "spec_decode_num_drafts" in engine:
        for name, help in SPEC_DECODE_COUNTERS.items():
            lines += _family(name + "_total", "counter", help, [({}, engine[name])])
        per_pos = engine["spec_decode_num_accepted_tokens_per_pos"]
        lines += _family(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "counter",
            "Accepted proposals, by position in the proposal.",
            [({"position": i}, n) for i, n in enumerate(per_pos)],
        )
    return lines


def _family(name: str, kind: str, help: str, samples: list[tuple[dict, float]]) -> list[str]:
    """One metric family: its HELP and TYPE lines, then a line per (labels, value) sample."""
    full = PREFIX + name
    lines = [f"# HELP {full} {help}", f"# TYPE {full} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(
            f"{full}{{{label_text}}} {_number(value)}" if label_text else f"{full} {_number(value)}"
        )
    return lines


def engine_gauges(llm) -> dict:
    """Read in the engine process between steps: the engine's queues, KV cache and prefix cache."""
    summary, engine = llm.metrics(), llm.engine
    return {
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "kv_usage": summary["kv_usage"],
        "blocks_used": engine.num_blocks - engine.num_free_blocks,
        "blocks_total": engine.num_blocks,
        "prefix_hit_rate": summary["prefix_hit_rate"],
        "preemptions": summary["preemptions"],
        **{name: value for name, value in summary.items() if name.startswith("spec_decode_")},
    }


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
