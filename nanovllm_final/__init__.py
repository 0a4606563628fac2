"""nanovllm_final: the finished engine of the staged nano-vllm course.

Paged KV cache, prefix caching, chunked prefill, CUDA graphs and tensor parallelism for
Qwen3, Qwen2 and Llama checkpoints, with vLLM's sampling (top-k, top-p, min-p, seeds,
stop strings, logprobs, n, penalties), chat, streaming and an engine-level request API::

    from nanovllm_final import LLM, SamplingParams
    with LLM("Qwen/Qwen3-0.6B") as llm:
        outs = llm.generate(["Hello"], SamplingParams(max_tokens=256))
        print(outs[0]["text"])

The README is its reference; the stages explain how each mechanism works.
"""

from .llm import LLM
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics"]
