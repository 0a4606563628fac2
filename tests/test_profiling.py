"""benchmarks/profiling.py's per-step attribution, on hand-made profiler events: each GPU
activity is charged to the step (and the sampler) whose host code launched it."""

import torch

from benchmarks.profiling import SAMPLE, STEP, analyze, summarize

CPU, GPU = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


class Event:
    def __init__(self, name, start, end, device=CPU, correlation=0):
        self._name, self._start, self._end, self._device, self._corr = (
            name,
            start,
            end,
            device,
            correlation,
        )

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def duration_ns(self):
        return self._end - self._start

    def device_type(self):
        return self._device

    def correlation_id(self):
        return self._corr


def test_gpu_time_is_charged_to_the_launching_step():
    ms = 1_000_000
    events = [
        Event(f"{STEP}0", 0, 10 * ms),
        Event(f"{STEP}1", 10 * ms, 14 * ms),
        Event(SAMPLE, 8 * ms, 9 * ms),
        Event("cudaGraphLaunch", 1 * ms, 2 * ms, correlation=7),
        Event("cudaLaunchKernel", 8 * ms, 8 * ms + 1000, correlation=8),  # inside the sampler
        Event("cudaLaunchKernel", 11 * ms, 11 * ms + 1000, correlation=9),
        Event("aten::mm", 1 * ms, 2 * ms, correlation=9),  # a CPU op's id is not a launch
        # two overlapping kernels of step 0's graph, one sampler kernel, one kernel of step 1
        # that runs after step 1's host code has returned (launched inside it: still step 1)
        Event("gemm", 2 * ms, 5 * ms, GPU, 7),
        Event("norm", 4 * ms, 6 * ms, GPU, 7),
        Event("argmax", 9 * ms, 9 * ms + ms // 2, GPU, 8),
        Event("attn", 12 * ms, 15 * ms, GPU, 9),
        # the profiler's copies of the annotations on the GPU timeline are not GPU work
        Event(f"{STEP}0", 0, 10 * ms, GPU, 0),
        Event(SAMPLE, 8 * ms, 9 * ms, GPU, 0),
    ]
    rows = analyze(events)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["gpu_ms"] == 4.5 and rows[0]["kernels"] == 3 and rows[0]["sampling_ms"] == 0.5
    assert rows[0]["idle_ms"] == 5.5
    assert rows[1]["gpu_ms"] == 3.0 and rows[1]["sampling_ms"] == 0.0
    # host before the first activity and after the last; step 1's kernel outlived its step
    assert (rows[0]["before_ms"], rows[0]["after_ms"]) == (2.0, 0.5)
    assert (rows[1]["before_ms"], rows[1]["after_ms"]) == (2.0, 0.0)
    # the GPU's idle gap inside step 0 is charged to the activities around it
    assert rows[0]["gaps"] == {"norm -> argmax": 3 * ms} and not rows[1]["gaps"]
    report = summarize(rows, {0: "prefill", 1: "decode"})
    assert report["summary"]["prefill"]["mean_gpu_ms"] == 4.5
    top = report["top_kernels"]["prefill"]
    assert top[0]["name"] == "gemm" and abs(sum(k["share"] for k in top) - 1) < 1e-9
    assert report["top_gaps"]["prefill"] == [{"between": "norm -> argmax", "ms_per_step": 3.0}]
    assert "gaps" not in report["steps"][0]
