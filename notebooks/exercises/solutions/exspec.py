"""Reference solutions for speculative.ipynb's exercises."""

import torch


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, draft: int, u: float, noise: torch.Tensor) -> int:
    if u < min(1.0, float(p[draft] / q[draft])):
        return draft
    return int(((p - q).clamp(min=0) / noise).argmax())


def ngram_propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):  # the last earlier occurrence first
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


def rollback(
    block_table: list[int], ref_counts: dict, free_blocks: list[int], num_tokens: int, block_size: int
) -> int:
    keep = -(-num_tokens // block_size)  # blocks that hold the kept tokens
    for block in block_table[keep:]:
        ref_counts[block] -= 1
        if ref_counts[block] == 0:
            free_blocks.append(block)
    del block_table[keep:]
    return (block_size - num_tokens % block_size) % block_size
