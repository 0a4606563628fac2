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
