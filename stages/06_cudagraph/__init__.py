"""Stage 06, cudagraph: replay recorded decode steps instead of launching kernels.

Unlike 05_chunked_prefill: on a CUDA device the model runner records one decode
step as a CUDA graph for each batch size of a ladder (1, 2, 4, 8, then multiples of
16 up to `max_num_seqs`), on static input/output buffers and one shared memory pool.
A decode step copies its inputs into the buffers, pads the batch up to the next
captured size, and replays the graph: hundreds of kernel launches become one.
Prefill and mixed steps stay eager, and so does everything with
`enforce_eager=True`, on CPU, or with the torch attention backend.

Still missing: tensor parallelism (07).
"""

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
