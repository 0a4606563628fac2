import struct
from collections import OrderedDict

import xxhash

from .sequence import Sequence


def block_hash(token_ids: list[int], prefix_hash: int) -> int:
    """NEW in 04_prefix_cache: a chained hash. Block i's hash covers its own tokens and
    the hash of block i-1, so equal hashes mean equal *prefixes*, not just equal blocks."""
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.intdigest()


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0  # how many sequences use this block
        self.hash = -1  # -1: not a full, hashed block
        self.token_ids: list[int] = []  # kept to confirm a hash hit

    def reset(self) -> None:
        self.ref_count, self.hash, self.token_ids = 1, -1, []


class BlockManager:
    """Hands out fixed-size KV-cache blocks from a free list.

    A sequence's `block_table` lists its physical blocks in order: token position p
    lives in block `block_table[p // block_size]` at offset `p % block_size`.

    NEW in 04_prefix_cache: full blocks are hashed and remembered in `hash_to_block_id`.
    A new sequence whose leading blocks hash the same (and hold the same tokens)
    shares those blocks instead of computing them again; reference counts say when a
    block is free. A freed block keeps its hash, so it can still be found until the
    free list hands it out again."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NEW in 04_prefix_cache: the free list, oldest first, is an ordered set, since a prefix
        # hit on a freed block takes it out of the middle: O(1) here, where a deque scans the list.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_hit_tokens = 0  # tokens served from the cache so far (for stats)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        """Are there enough free blocks for the whole sequence as it is now? (Cache hits
        may need fewer; this check is conservative.)"""
        return self.blocks_needed(len(seq)) <= self.num_free_blocks

    def _take_free_block(self) -> int:
        block = self.blocks[self.free_block_ids.popitem(last=False)[0]]
        if self.hash_to_block_id.get(block.hash) == block.block_id:
            del self.hash_to_block_id[block.hash]  # its old contents are about to be overwritten
        block.reset()
        return block.block_id

    def _register(self, block: Block, token_ids: list[int], prefix_hash: int) -> None:
        block.hash, block.token_ids = block_hash(token_ids, prefix_hash), list(token_ids)
        self.hash_to_block_id[block.hash] = block.block_id

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence its blocks, sharing cached ones for its leading full blocks.
        The block holding the last token is always computed, so the step has a query."""
        assert not seq.block_table, "sequence already holds blocks"
        prefix_hash, cache_miss = -1, False
        for i in range(self.blocks_needed(len(seq))):
            token_ids = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            block_id = -1
            if not cache_miss and (i + 1) * self.block_size < len(seq):
                prefix_hash = block_hash(token_ids, prefix_hash)
                block_id = self.hash_to_block_id.get(prefix_hash, -1)
                if block_id != -1 and self.blocks[block_id].token_ids != token_ids:
                    block_id = -1  # a hash collision: the tokens differ
            if block_id == -1:
                cache_miss = True
                block_id = self._take_free_block()
            else:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self.free_block_ids[block_id]  # a freed block, still holding its K/V
                block.ref_count += 1
                seq.num_cached_tokens += self.block_size
                self.num_hit_tokens += self.block_size
            seq.block_table.append(block_id)

    def hash_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that the K/V of the sequence's first `num_tokens` tokens
        just filled (those past `seq.num_cached_tokens`). Only blocks whose K/V are
        really in the cache can be found, so no one ever reads a block still being computed."""
        for i in range(seq.num_cached_tokens // self.block_size, num_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash == -1:
                prefix_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else -1
                self._register(
                    block,
                    seq.token_ids[i * self.block_size : (i + 1) * self.block_size],
                    prefix_hash,
                )

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None  # at the back: the last to be handed out again
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        """Can the sequence's newest token get a slot (a fresh block if the last one is full)?"""
        missing = self.blocks_needed(len(seq)) - len(seq.block_table)
        return missing <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        while len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self._take_free_block())
