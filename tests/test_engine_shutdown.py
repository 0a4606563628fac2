"""The engine after shutdown(): step() and add_request() raise a clear error, and a second
shutdown() does nothing."""

import pytest

from nanovllm_final import LLM, SamplingParams


def test_the_engine_after_shutdown(model_dir):
    llm = LLM(
        model_dir("qwen3"),
        device="cpu",
        max_model_len=64,
        kvcache_block_size=4,
        num_kvcache_blocks=16,
    )
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    engine.shutdown()  # a no-op
    llm.shutdown()
    llm.shutdown()
