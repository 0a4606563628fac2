"""Stage 05, chunked_prefill: a token budget per step, and prompts split to fit it.

Unlike 04_prefix_cache: a step is no longer either a prefill or a decode. The
scheduler fills a budget of `max_num_batched_tokens` tokens: first one token for
every decoding sequence (or the next chunk of a prompt still being prefilled), then
chunks of waiting prompts. A prompt longer than what is left is split across steps;
each chunk's queries attend to the earlier chunks through the paged cache, and no
token is sampled for a sequence until its whole prompt is in the cache.

Still missing: CUDA graphs (06), tensor parallelism (07).
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
