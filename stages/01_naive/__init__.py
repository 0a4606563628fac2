"""Stage 01, naive: a correct engine and nothing more.

Our own Qwen3/Llama model (embedding, RMSNorm, rotary, GQA attention, SwiGLU MLP)
and Qwen3-MoE's router and experts, a safetensors loader, a Gumbel-max sampler and `LLM.generate`. Every step feeds
every token of every unfinished sequence through the model again and keeps only
the last position's logits, so the cost of step t grows with t and the whole
generation is quadratic in its length.

Still missing: a KV cache (02), paging and continuous batching (03), prefix
caching (04), chunked prefill (05), CUDA graphs (06), tensor parallelism (07).
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
