"""Reference solutions for 04_prefix_cache.ipynb."""

import importlib

block_hash = importlib.import_module("stages.04_prefix_cache.engine.block_manager").block_hash


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    hashes, prefix_hash = [], -1
    for start in range(0, len(token_ids) - block_size + 1, block_size):  # full blocks only
        prefix_hash = block_hash(token_ids[start : start + block_size], prefix_hash)
        hashes.append(prefix_hash)
    return hashes


def cached_blocks(token_ids: list[int], block_size: int, hash_to_block_id: dict, block_token_ids: dict) -> list[int]:
    shared, prefix_hash = [], -1
    for start in range(0, len(token_ids), block_size):
        if start + block_size >= len(token_ids):
            break  # the block holding the last token is always computed: its logits are needed
        block = token_ids[start : start + block_size]
        prefix_hash = block_hash(block, prefix_hash)
        block_id = hash_to_block_id.get(prefix_hash)
        if block_id is None or block_token_ids.get(block_id) != block:
            break  # the first miss ends the reuse
        shared.append(block_id)
    return shared


class PrefixBlockManager:
    """A free list of blocks with reference counts, and a map from chained hashes to blocks."""

    def __init__(self, num_blocks: int, block_size: int):
        from collections import deque

        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_block_ids = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_hash_of = [-1] * num_blocks  # -1: not a full, registered block
        self.block_tokens: list[list[int]] = [[] for _ in range(num_blocks)]  # to confirm a hit
        self.hash_to_block_id: dict[int, int] = {}
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq) -> bool:
        return self.blocks_needed(len(seq)) <= self.num_free_blocks

    def take_free_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        if self.hash_to_block_id.get(self.block_hash_of[block_id]) == block_id:
            del self.hash_to_block_id[self.block_hash_of[block_id]]  # evicted: its K/V are about to be overwritten
        self.ref_count[block_id], self.block_hash_of[block_id], self.block_tokens[block_id] = 1, -1, []
        return block_id

    def allocate(self, seq) -> None:
        prefix_hash, missed, size = -1, False, self.block_size
        for i in range(self.blocks_needed(len(seq))):
            tokens = seq.token_ids[i * size : (i + 1) * size]
            block_id = -1
            if not missed and (i + 1) * size < len(seq):  # a full block, not the one holding the last token
                prefix_hash = block_hash(tokens, prefix_hash)
                block_id = self.hash_to_block_id.get(prefix_hash, -1)
                if block_id != -1 and self.block_tokens[block_id] != tokens:
                    block_id = -1  # a collision
            if block_id == -1:
                missed = True
                block_id = self.take_free_block()
            else:
                if self.ref_count[block_id] == 0:
                    self.free_block_ids.remove(block_id)  # freed, but its K/V are still there
                self.ref_count[block_id] += 1
                seq.num_cached_tokens += size
                self.num_hit_tokens += size
            seq.block_table.append(block_id)

    def hash_blocks(self, seq, num_tokens: int) -> None:
        size = self.block_size
        for i in range(seq.num_cached_tokens // size, num_tokens // size):
            block_id = seq.block_table[i]
            if self.block_hash_of[block_id] == -1:
                prefix_hash = self.block_hash_of[seq.block_table[i - 1]] if i > 0 else -1
                tokens = seq.token_ids[i * size : (i + 1) * size]
                self.block_hash_of[block_id], self.block_tokens[block_id] = block_hash(tokens, prefix_hash), list(tokens)
                self.hash_to_block_id[self.block_hash_of[block_id]] = block_id

    def deallocate(self, seq) -> None:
        for block_id in reversed(seq.block_table):  # the last block first: it is the least likely to be shared
            self.ref_count[block_id] -= 1
            if self.ref_count[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()

    def can_append(self, seq) -> bool:
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq) -> None:
        while len(seq.block_table) < self.blocks_needed(len(seq)):
            seq.block_table.append(self.take_free_block())
