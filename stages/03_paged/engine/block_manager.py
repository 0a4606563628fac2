from collections import deque

from .sequence import Sequence


class BlockManager:
    """Hands out fixed-size KV-cache blocks from a free list.

    A sequence's `block_table` lists its physical blocks in order: token position p
    lives in block `block_table[p // block_size]` at offset `p % block_size`. Blocks
    are taken as a sequence grows and all returned when it finishes or is preempted,
    so memory is held in proportion to tokens actually cached, not to `max_model_len`."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        """Are there enough free blocks for the whole sequence as it is now?"""
        return self.blocks_needed(len(seq)) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table, "sequence already holds blocks"
        for _ in range(self.blocks_needed(len(seq))):
            seq.block_table.append(self.free_block_ids.popleft())

    def deallocate(self, seq: Sequence) -> None:
        self.free_block_ids.extend(seq.block_table)
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        """Can the sequence's newest token get a slot (a fresh block if the last one is full)?"""
        missing = self.blocks_needed(len(seq)) - len(seq.block_table)
        return missing <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        while len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self.free_block_ids.popleft())
