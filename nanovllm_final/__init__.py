"""nanovllm_final: the finished engine of the staged nano-vllm course.

Paged KV cache, prefix caching, chunked prefill, CUDA graphs and tensor
parallelism for Qwen3 and Llama checkpoints, with the public API of every stage::

    from nanovllm_final import LLM, SamplingParams
    with LLM("path/to/checkpoint", tensor_parallel_size=1) as llm:
        outs = llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=256))

It is stage 07_tensor_parallel, installable; explanations live in the stages.
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
