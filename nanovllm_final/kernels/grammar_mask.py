"""Structured output's token mask in Triton, read from the packed bitmask. Reference:
engine/structured.py's apply_bitmask_reference; tests/test_structured.py checks this against
it under TRITON_INTERPRET=1.

One launch writes -inf over the disallowed logits of the constrained rows, in place: bit j of
word w of a bitmask row allows token 32 w + j; tokens past the bitmask's words are disallowed
(the ids past the tokenizer, which no grammar produces). A block of tokens past the words only
stores -inf; a block inside them reads its logits and stores them back, -inf where the bit is
clear: whole-block loads and stores (a store of the disallowed tokens alone is predicated token by
token, and runs at a fraction of the memory's bandwidth). The PyTorch code unpacks the bits into
an int32 (rows, words, 32) temporary and copies the rows."""

import torch
import triton
import triton.language as tl

BLOCK = 1024  # tokens per program


@triton.jit
def _mask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words, stride, BLOCK: tl.constexpr):
    i = tl.program_id(0)  # the bitmask's row; its logits row is rows[i]
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    tokens = start + tl.arange(0, BLOCK)  # (BLOCK,)
    ptrs = logits_ptr + row * stride + tokens
    if start >= words * 32:  # past the bitmask: no token allowed
        tl.store(ptrs, float("-inf"), mask=tokens < vocab)
    else:
        word = tokens // 32
        packed = tl.load(
            bitmask_ptr + i * words + word, mask=(tokens < vocab) & (word < words), other=0
        )
        allowed = ((packed >> (tokens % 32)) & 1) != 0
        logits = tl.load(ptrs, mask=tokens < vocab)
        tl.store(ptrs, tl.where(allowed, logits, float("-inf")), mask=tokens < vocab)


def mask_logits_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits (rows_all, vocab), in place: each row rows[i] (c,) keeps only the tokens bitmask[i]
    (c, words) int32 allows; the others, and the tokens past 32 * words, become -inf."""
    assert logits.stride(1) == 1 and bitmask.dtype == torch.int32 and bitmask.is_contiguous()
    count, vocab = rows.shape[0], logits.shape[1]
    if count:
        grid = (count, triton.cdiv(vocab, BLOCK))
        # fmt: off
        _mask_kernel[grid](
            logits, bitmask, rows, vocab, bitmask.shape[1], logits.stride(0), BLOCK=BLOCK,
            num_warps=4,
        )
        # fmt: on
    return logits
