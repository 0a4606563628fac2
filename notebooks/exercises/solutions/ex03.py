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


class BlockManager:
    """A free list of block ids; a sequence's block_table lists its blocks in order."""

    def __init__(self, num_blocks: int, block_size: int):
        from collections import deque

        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_block_ids = deque(range(num_blocks))  # taken from the front, returned at the back

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq) -> bool:
        return self.blocks_needed(len(seq)) <= self.num_free_blocks

    def allocate(self, seq) -> None:
        for _ in range(self.blocks_needed(len(seq))):
            seq.block_table.append(self.free_block_ids.popleft())

    def deallocate(self, seq) -> None:
        self.free_block_ids.extend(seq.block_table)
        seq.block_table.clear()

    def can_append(self, seq) -> bool:  # the newest token needs a fresh block when the last one is full
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq) -> None:
        while len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self.free_block_ids.popleft())
