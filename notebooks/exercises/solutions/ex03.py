"""Reference solutions for 03_paged.ipynb."""

import torch


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    # cache: (num_blocks, block_size, kv_heads, head_dim); block_table: (max_blocks,), padded with -1
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)  # the blocks that hold the context
    blocks = cache[block_table[:num_blocks].long()]  # (num_blocks, block_size, kv_heads, head_dim)
    return blocks.flatten(0, 1)[:context_len]  # (context_len, kv_heads, head_dim)
