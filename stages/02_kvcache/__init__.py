"""Stage 02, kvcache: prefill once, then one token per step.

Unlike 01_naive: each layer keeps the keys and values of every token it has seen
in a KV cache, so a step only feeds the tokens that are not cached yet — the whole
prompt at prefill, one token per sequence at decode — and per-step cost no longer
grows with the length. The cache is contiguous: every batch slot reserves a row of
`max_model_len` slots up front, used or not, and batching is still static.

Still missing: paging and continuous batching (03), prefix caching (04), chunked
prefill (05), CUDA graphs (06), tensor parallelism (07).
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
