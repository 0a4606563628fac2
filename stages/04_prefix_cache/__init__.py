"""Stage 04, prefix_cache: compute a shared prompt prefix once.

Unlike 03_paged: every full KV block is identified by a chained xxh64 hash of its
tokens and the hash of the block before it. The block manager remembers which
physical block holds each hash; a new sequence whose leading blocks match (hash and
tokens) shares those blocks, with reference counts, and only the rest of its prompt
is computed. Freed blocks keep their contents and stay findable until reused.

Still missing: chunked prefill (05), CUDA graphs (06), tensor parallelism (07).
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
