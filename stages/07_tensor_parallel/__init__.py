"""Stage 07, tensor_parallel: the model split across devices, one process per rank.

Unlike 06_cudagraph: with `tensor_parallel_size=N` every rank holds 1/N of the
weights and of the KV cache. The q/k/v and gate/up projections are column parallel
(each rank computes whole attention heads and a slice of the MLP), o_proj and down_proj
are row parallel (partial sums, all-reduced), the embedding is split by vocabulary
(masked lookups, all-reduced) and the LM head gathers its logits on rank 0. Rank 0, this
process, schedules and samples; ranks 1..N-1 are spawned worker processes that it drives
through pipes and watches. NCCL on CUDA, gloo on CPU.

Still missing: nothing in the ladder. `nanovllm_final` is this engine, packaged for
real runs.
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
