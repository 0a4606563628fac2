"""Stage 03, paged: a block pool for the KV cache, and continuous batching.

Unlike 02_kvcache: the cache is a pool of fixed-size blocks shared by every
sequence; a block manager hands them out as sequences grow and takes them back
when they finish, and each sequence finds its K/V through a block table. The
scheduler admits new requests whenever there is room (continuous batching),
prefers prefill steps, and preempts the newest sequence when decode runs out of
blocks. Attention reads the paged cache through one of three backends: the PyTorch
reference, our Triton kernels, or flash-attn.

Still missing: prefix caching (04), chunked prefill (05), CUDA graphs (06),
tensor parallelism (07).
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
