"""Checks for 04_prefix_cache.ipynb: the chained block hash, and which blocks a new sequence
finds in the prefix cache."""

import torch

from . import stage
from .report import expect_equal, fail

STAGE = "04_prefix_cache"


def _manager(block_size: int, num_blocks: int = 32):
    return stage.module(STAGE, "engine.block_manager").BlockManager(num_blocks=num_blocks, block_size=block_size)


def _sequence(token_ids):
    st = stage.load(STAGE)
    return stage.module(STAGE, "engine.sequence").Sequence(list(token_ids), st.SamplingParams())


def check_prefix_hashes(prefix_hashes) -> str:
    """prefix_hashes(token_ids, block_size) -> the chained hash of every full block, using the
    stage's block_hash(token_ids, prefix_hash). Compared with the hashes the stage's BlockManager
    registers once the sequence's K/V are computed."""
    g = torch.Generator().manual_seed(6)
    checked = 0
    for block_size, length in ((4, 11), (4, 8), (4, 3), (3, 10), (5, 25)):
        token_ids = torch.randint(3, 500, (length,), generator=g).tolist()
        bm, seq = _manager(block_size), _sequence(token_ids)
        bm.allocate(seq)
        bm.hash_blocks(seq, len(seq))  # as the scheduler does after the step that computed them
        expected = [bm.blocks[b].hash for b in seq.block_table[: length // block_size]]
        got = prefix_hashes(list(token_ids), block_size)
        if not isinstance(got, list) or len(got) != len(expected):
            fail("return one hash per full block (a partly filled last block has none)", token_ids=token_ids,
                 block_size=block_size, expected=f"{len(expected)} hashes",
                 got=f"{len(got)} hashes" if isinstance(got, list) else type(got).__name__)
        for i, (mine, theirs) in enumerate(zip(got, expected)):
            if mine != theirs:
                fail(f"block {i}'s hash differs from the one the stage registers: hash its tokens together with "
                     f"the previous block's hash (-1 for the first block)", token_ids=token_ids, block_size=block_size,
                     block=token_ids[i * block_size : (i + 1) * block_size], expected=f"{theirs:016x}", got=f"{mine:016x}")
        checked += 1
    return f"the same chained hashes as the stage's BlockManager for {checked} sequences"


def _scenario(block_size: int):
    """A manager with two sequences' blocks computed and registered; returns it and their tokens."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 500, (3 * block_size,), generator=g).tolist()  # three shared blocks
    a = system + torch.randint(3, 500, (2,), generator=g).tolist()
    b = system[:block_size] + torch.randint(3, 500, (2 * block_size + 1,), generator=g).tolist()
    bm = _manager(block_size)
    for tokens in (a, b):
        seq = _sequence(tokens)
        bm.allocate(seq)
        bm.hash_blocks(seq, len(seq))
    return bm, system, g


def check_cached_blocks(cached_blocks) -> str:
    """cached_blocks(token_ids, block_size, hash_to_block_id, block_token_ids) -> the ids of the
    leading blocks a new sequence shares. Compared with what the stage's BlockManager.allocate
    shares, for new sequences that hit, partly hit, miss, end on a block boundary, or meet a
    hash whose stored tokens differ (a collision)."""
    block_size = 4
    cases = {  # name -> a function of (system prompt, generator) giving the new sequence's tokens
        "the system prompt plus 3 tokens": lambda s, g: s + [7, 8, 9],
        "the first two blocks of the system prompt, then other tokens": lambda s, g: s[:8] + [5] * 6,
        "the system prompt exactly (3 full blocks, the last token in block 2)": lambda s, g: list(s),
        "a different first token": lambda s, g: [1] + s[1:] + [7],
        "a prompt shorter than one block": lambda s, g: s[:3],
        "the system prompt with its second block changed": lambda s, g: s[:4] + [9, 9, 9, 9] + s[8:] + [3],
    }
    for name, make in [*cases.items(), ("a hash collision: a stored block's tokens differ from the new ones", None)]:
        bm, system, g = _scenario(block_size)
        if make is None:  # plant a collision: block 1 of the prompt claims other tokens
            token_ids = system + [7, 8, 9]
            victim = next(b for b in bm.blocks if b.hash != -1 and b.token_ids == system[4:8])
            victim.token_ids = [0, 0, 0, 0]  # as if another block's tokens had hashed to the same value
        else:
            token_ids = make(system, g)
        hash_map = dict(bm.hash_to_block_id)
        stored = {b.block_id: list(b.token_ids) for b in bm.blocks if b.hash != -1}
        seq = _sequence(token_ids)
        bm.allocate(seq)
        expected = seq.block_table[: seq.num_cached_tokens // block_size]
        got = cached_blocks(list(token_ids), block_size, dict(hash_map), {k: list(v) for k, v in stored.items()})
        expect_equal(got, expected, f"{name}: the shared blocks differ from the stage's allocate "
                     "(full blocks only, never the block holding the last token, stop at the first miss, and "
                     "confirm that the stored tokens are the same)", token_ids=token_ids, block_size=block_size)
    return f"the same shared blocks as the stage's allocate in {len(cases) + 1} cases (hits, misses, a block boundary, a collision)"


def cache_state(engine, index: dict) -> dict:
    """What a step leaves in the block manager: each running request's block table, the free
    list, and which blocks the hash map can find."""
    bm = engine.scheduler.block_manager
    return {"tables": {index[s.seq_id]: list(s.block_table) for s in engine.scheduler.running},
            "free": list(bm.free_block_ids), "registered": sorted(bm.hash_to_block_id.values())}


def shared_prefix_workload(seed: int, num: int, prefix_len: int, prefixes: int = 1):
    """num prompts: one of `prefixes` shared prefixes of prefix_len tokens, then 1-6 of their own."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, 500, (prefix_len,), generator=g).tolist() for _ in range(prefixes)]
    prompts = [heads[i % prefixes] + torch.randint(3, 500, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
               for i in range(num)]
    return prompts, torch.randint(4, 13, (num,), generator=g).tolist()


PREFIX_CASES = [  # (seed, requests, prefix length, distinct prefixes, block size, pool, max_num_seqs)
    (0, 7, 16, 1, 4, 64, 3),  # room to spare: every later request hits
    (1, 8, 12, 2, 4, 16, 2),  # two prefixes in turn, a pool so small that freed blocks are taken back
    (2, 8, 10, 1, 3, 24, 4),  # a prefix that ends inside a block
]


def check_prefix_block_manager(PrefixBlockManager) -> str:
    """STRETCH. PrefixBlockManager(num_blocks, block_size): the stage's block manager with
    reference counts and the prefix cache, written again (what 03's had, plus hash_to_block_id,
    num_hit_tokens, hash_blocks, and sharing in allocate). Installed in the stage's own engine
    on shared-prefix workloads, one with a pool small enough that cached blocks are evicted
    (taken from the free list for new tokens, their hash forgotten); the completions, every
    step's record (prefix hits included), the block tables, the free list and the registered
    blocks after every step must be the same as with the stage's."""
    steps = 0
    for seed, num, prefix_len, prefixes, block_size, num_blocks, max_num_seqs in PREFIX_CASES:
        prompts, max_tokens = shared_prefix_workload(seed, num, prefix_len, prefixes)

        def install(llm):
            bm = PrefixBlockManager(num_blocks, block_size)
            llm.engine.block_manager = llm.engine.scheduler.block_manager = bm

        options = dict(kvcache_block_size=block_size, num_kvcache_blocks=num_blocks, max_model_len=48,
                       max_num_seqs=max_num_seqs)
        steps += stage.compare_runs(STAGE, options, prompts, max_tokens, install, "BlockManager", trace=cache_state,
                                    inputs=dict(requests=num, prefix_len=prefix_len, prefixes=prefixes,
                                                block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs))
    return (f"in the stage's engine, the same tokens, prefix hits, block tables, free list and registered blocks as its "
            f"own BlockManager over {steps} steps of {len(PREFIX_CASES)} shared-prefix workloads, eviction included")
