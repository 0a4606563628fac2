"""The notebooks' exercises: every check passes on its reference solution and fails, with an
ExerciseFailed that says what is wrong, on planted wrong answers (at least one per check)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = (
        "1"  # the kernels notebook's Triton solutions: before triton is imported
    )

import importlib  # noqa: E402
from collections import deque  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

exercises = importlib.import_module("notebooks.exercises")
ExerciseFailed = exercises.ExerciseFailed


K = "kernels"  # kernels.ipynb's exercises: exkernels.py
S = "spec"  # speculative.ipynb's exercises: exspec.py


def _name(n: int | str) -> str:
    return f"ex{n:02d}" if isinstance(n, int) else f"ex{n}"


def ex(n: int | str):
    return importlib.import_module(f"notebooks.exercises.{_name(n)}")


def sol(n: int | str):
    return importlib.import_module(f"notebooks.exercises.solutions.{_name(n)}")


CHECKS = [
    (1, "naive_generate"),
    (1, "gumbel_max"),
    (1, "filter_probs"),
    (1, "route"),
    (1, "expert_load"),
    (2, "step_inputs"),
    (2, "attend_cached"),
    (2, "static_scheduler"),
    (3, "slot_mapping"),
    (3, "gather_kv"),
    (3, "block_manager"),
    (4, "prefix_hashes"),
    (4, "cached_blocks"),
    (4, "prefix_block_manager"),
    (5, "plan_step"),
    (5, "document_chunks"),
    (5, "schedule"),
    (6, "graph_batch_sizes"),
    (6, "pad_for_graph"),
    (6, "replay"),
    (7, "row_parallel_linear"),
    (7, "qkv_rows"),
    (7, "tp_mlp"),
    (K, "merge_splits"),
    (K, "prefill_key_tiles"),
    (K, "quantize_kv"),
    (K, "store_kvcache"),
    (S, "accept_or_resample"),
    (S, "ngram_propose"),
    (S, "rollback"),
]
REFERENCE = {
    "static_scheduler": "StaticBatchScheduler",
    "block_manager": "BlockManager",
    "prefix_block_manager": "PrefixBlockManager",
}  # classes: check_NAME checks solutions' CLASS


def reference(n, name):
    return getattr(sol(n), REFERENCE.get(name, name))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only cost time on a busy machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n, name", CHECKS, ids=[f"{_name(n)}-{name}" for n, name in CHECKS])
def test_reference_solution_passes(n, name):
    summary = getattr(ex(n), f"check_{name}")(reference(n, name))
    assert isinstance(summary, str) and summary


def test_every_notebook_exercise_is_listed():
    for n in [*range(1, 8), K, S]:
        checks = {k.removeprefix("check_") for k in vars(ex(n)) if k.startswith("check_")}
        assert checks == {name for m, name in CHECKS if m == n}
        assert all(callable(reference(n, name)) for name in checks)
        assert any(
            getattr(ex(n), f"check_{name}").__doc__.startswith("STRETCH") for name in checks
        )  # one each


# ---- planted wrong answers: each one a mistake a learner could make ----


def _softmax(logits, t):
    return torch.softmax(logits / t.clamp(min=1e-5).unsqueeze(1), dim=-1)


def _naive_last_token_only(
    next_logits, prompt, n
):  # feeds only the newest token: no cache, wrong tokens
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(next_logits(ids[-1:]).argmax()))
    return ids[len(prompt) :]


def _naive_extra_call(next_logits, prompt, n):  # right tokens, one call too many
    out = sol(1).naive_generate(next_logits, prompt, n)
    next_logits(list(prompt) + out)
    return out


def _route_softmax_after_topk(
    logits, k, renormalize
):  # the softmax over the k kept logits: always sums to 1
    kept, ids = logits.topk(k, dim=-1)
    return torch.softmax(kept.float(), dim=-1).to(logits.dtype), ids


def _route_softmax_over_tokens(
    logits, k, renormalize
):  # normalises each expert's column, not each token's row
    weights, ids = torch.softmax(logits.float(), dim=0).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True) if renormalize else weights
    return weights.to(logits.dtype), ids


def _route_topk_over_tokens(logits, k, renormalize):  # the k tokens that like each expert most
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=0)
    return weights.to(logits.dtype), ids


def _slots_no_cache(token_ids, cached, row, max_len):  # feeds the whole sequence every step
    return sol(2).step_inputs(token_ids, 0, row, max_len)


def _slots_ignore_row(token_ids, cached, row, max_len):
    ids, positions, _ = sol(2).step_inputs(token_ids, cached, row, max_len)
    return ids, positions, positions


def _attend_no_write(q, k, v, k_row, v_row, start):  # writes into copies: the cache is never filled
    return sol(2).attend_cached(q, k, v, k_row.clone(), v_row.clone(), start)


def _attend_not_causal(q, k, v, k_row, v_row, start):
    n = q.shape[0]
    k_row[start : start + n], v_row[start : start + n] = k, v
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k_row[: start + n].transpose(0, 1),
        v_row[: start + n].transpose(0, 1),
        enable_gqa=True,
    )
    return out.transpose(0, 1)


def _attend_gqa_repeat(
    q, k, v, k_row, v_row, start
):  # KV heads tiled (0, 1, 0, 1) instead of grouped
    n, heads, d = q.shape
    k_row[start : start + n], v_row[start : start + n] = k, v
    group = heads // k.shape[1]
    keys, values = k_row[: start + n].repeat(1, group, 1), v_row[: start + n].repeat(1, group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * d**-0.5
    mask = torch.arange(start + n)[None, :] > torch.arange(start, start + n)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, float("-inf")).softmax(-1), values)


def _gather_flat(cache, table, n):  # ignores the block table
    return cache.flatten(0, 1)[:n]


def _gather_floor(cache, table, n):  # drops the partly filled last block
    return cache[table[: n // cache.shape[1]].long()].flatten(0, 1)


def _bh(tokens, prefix):
    return sol(4).block_hash(tokens, prefix)


def _cached_with_last_block(t, bs, hash_map, stored):  # may share the block holding the last token
    out, h = [], -1
    for s in range(0, len(t) - bs + 1, bs):
        h = _bh(t[s : s + bs], h)
        if hash_map.get(h) is None or stored.get(hash_map[h]) != t[s : s + bs]:
            break
        out.append(hash_map[h])
    return out


def _cached_unconfirmed(t, bs, hash_map, stored):  # trusts the hash alone
    return sol(4).cached_blocks(
        t,
        bs,
        hash_map,
        {b: t[i * bs : (i + 1) * bs] for i, b in enumerate(_chain_ids(t, bs, hash_map))},
    )


def _chain_ids(t, bs, hash_map):
    ids, h = [], -1
    for s in range(0, len(t) - bs, bs):
        h = _bh(t[s : s + bs], h)
        ids.append(hash_map.get(h, -2))
    return ids


def _cached_unchained(t, bs, hash_map, stored):
    out = []
    for s in range(0, len(t) - bs, bs):
        b = hash_map.get(_bh(t[s : s + bs], -1))
        if b is None or stored.get(b) != t[s : s + bs]:
            break
        out.append(b)
    return out


def _plan_waiting_first(r, w, b, m):
    return sol(5).plan_step([], w, b, m - len(r)) + sol(5).plan_step(r, [], b, m)


def _plan_no_budget_cap(r, w, b, m):
    return (list(r) + list(w))[:m]


def _plan_no_seat_limit(r, w, b, m):
    return sol(5).plan_step(r, w, b, 10**6)


def _pad(s, lens, sizes, bs, slot_pad, len_pad):
    return bs, s + [slot_pad] * (bs - len(s)), lens + [len_pad] * (bs - len(s))


def _next_size(s, sizes):
    return min(x for x in sizes if x >= len(s))


def _row_parallel_bias_everywhere(x, w, b, tp):
    partials, _ = sol(7).row_parallel_linear(x, w, torch.zeros_like(b), tp)
    partials = [p + b for p in partials]
    return partials, sum(partials)


def _row_parallel_concatenated(x, w, b, tp):
    partials, _ = sol(7).row_parallel_linear(x, w, b, tp)
    return partials, torch.cat(partials, dim=-1)


def _row_parallel_split_outputs(x, w, b, tp):  # splits W by rows: that is column parallel
    h = w.shape[0] // tp
    partials = [x @ w[r * h : (r + 1) * h].T + b[r * h : (r + 1) * h] for r in range(tp)]
    return partials, torch.cat(partials, dim=-1)


# -- the stretch exercises --


def _filter_unnormalised(l, t, k, p, m):
    out = sol(1).filter_probs(l, t, k, p, m)
    return out * torch.softmax(l / t.unsqueeze(1), -1).where(out > 0, 0).sum(-1, keepdim=True)


def _filter_p_inclusive(l, t, k, p, m):  # drops the token that crosses top_p
    probs = torch.softmax(l / t.unsqueeze(1), -1)
    sp, order = probs.sort(-1, descending=True)
    keep = sp.cumsum(-1) <= p.unsqueeze(1)
    keep[:, 0] = True
    keep = torch.zeros_like(keep).scatter(-1, order, keep)
    out = sol(1).filter_probs(l, t, k, torch.ones_like(p), m) * keep
    return out / out.sum(-1, keepdim=True)


def _filter_min_p_absolute(l, t, k, p, m):
    out = sol(1).filter_probs(l, t, k, p, torch.zeros_like(m))
    out = out * (torch.softmax(l / t.unsqueeze(1), -1) >= m.unsqueeze(1))
    return out / out.sum(-1, keepdim=True)


def _filter_k0_keeps_none(l, t, k, p, m):
    return sol(1).filter_probs(
        l, t, torch.where(k == 0, 1, k), p, m
    )  # top_k = 0 read as "keep one"


class _ContinuousRows(
    sol(2).StaticBatchScheduler
):  # fills a freed row at once: not static batching
    def schedule(self):
        self.running = [s for s in self.running if not s.is_finished]
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.status, seq.cache_row = type(seq.status).RUNNING, len(self.running)
            self.running.append(seq)
        return list(self.running)


class _NoCacheBookkeeping(
    sol(2).StaticBatchScheduler
):  # never advances num_cached_tokens: feeds everything
    def postprocess(self, seqs, token_ids):
        cached = [s.num_cached_tokens for s in seqs]
        finished = super().postprocess(seqs, token_ids)
        for s, c in zip(seqs, cached):
            s.num_cached_tokens = c
        return finished


class _NoLengthLimit(sol(2).StaticBatchScheduler):
    def __init__(self, max_num_seqs, max_model_len, eos):
        super().__init__(max_num_seqs, 10**6, eos)


class _LifoFree(sol(3).BlockManager):  # returned blocks go to the front
    def deallocate(self, seq):
        self.free_block_ids.extendleft(seq.block_table)
        seq.block_table.clear()


class _Leaks(sol(3).BlockManager):  # never gives blocks back
    def deallocate(self, seq):
        seq.block_table.clear()


class _AlwaysRoom(
    sol(3).BlockManager
):  # never says the pool is full: no preemption, then an empty deque
    def can_append(self, seq):
        return True


class _NoEviction(sol(4).PrefixBlockManager):  # a reused block keeps its old entry in the hash map
    def take_free_block(self):
        block_id = self.free_block_ids.popleft()
        self.ref_count[block_id], self.block_tokens[block_id] = 1, []
        self.block_hash_of[block_id] = -1
        return block_id


class _NoRefCounts(sol(4).PrefixBlockManager):  # frees a block when any of its users finishes
    def deallocate(self, seq):
        for block_id in reversed(seq.block_table):
            self.ref_count[block_id] = 0
            if block_id not in self.free_block_ids:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()


class _ForgetsOnFree(
    sol(4).PrefixBlockManager
):  # a freed block loses its hash: no reuse after a request ends
    def deallocate(self, seq):
        for block_id in seq.block_table:
            if (
                self.ref_count[block_id] == 1
                and self.hash_to_block_id.get(self.block_hash_of[block_id]) == block_id
            ):
                del self.hash_to_block_id[self.block_hash_of[block_id]]
                self.block_hash_of[block_id] = -1
        super().deallocate(seq)


def _schedule_waiting_first(self):
    running, self.running = self.running, deque()
    scheduled = sol(5).schedule(self)  # admits first, then...
    self.running.extendleft(reversed(running))
    return scheduled


def _schedule_no_chunks(self):  # admits whole prompts, over the budget
    budget = self.max_num_batched_tokens
    self.max_num_batched_tokens = 10**6
    try:
        return sol(5).schedule(self)
    finally:
        self.max_num_batched_tokens = budget


class _OldestFirst(deque):
    def pop(self):
        return self.popleft()


def _schedule_preempts_oldest(self):  # makes room by preempting the first admitted, not the last
    self.running = _OldestFirst(self.running)
    return sol(5).schedule(self)


def _replay_no_padding(self, ids, positions, context):
    slots, lens = (
        self.graph_inputs["slot_mapping"].clone(),
        self.graph_inputs["context_lens"].clone(),
    )
    out = sol(6).replay(self, ids, positions, context)
    n = len(ids)
    self.graph_inputs["slot_mapping"][n:], self.graph_inputs["context_lens"][n:] = (
        slots[n:],
        lens[n:],
    )  # garbage stays
    return out


def _replay_largest(self, ids, positions, context):
    sizes, self.graph_sizes = self.graph_sizes, self.graph_sizes[-1:]
    try:
        return sol(6).replay(self, ids, positions, context)
    finally:
        self.graph_sizes = sizes


def _replay_uncounted(self, ids, positions, context):
    out = sol(6).replay(self, ids, positions, context)
    self.num_graph_replays -= 1
    return out


def _replay_no_tables(self, ids, positions, context):
    tables = self.graph_inputs["block_tables"].clone()
    out = sol(6).replay(self, ids, positions, context)
    self.graph_inputs["block_tables"].copy_(tables)
    return out


def _mlp_fused_rows(
    x, gate, up, down, tp
):  # splits the fused [gate | up] weight in contiguous blocks
    fused, share = torch.cat([gate, up]), 2 * gate.shape[0] // tp
    partials = []
    for r in range(tp):
        g, u = (x @ fused[r * share : (r + 1) * share].T).chunk(2, dim=-1)
        partials.append((F.silu(g) * u) @ down[:, r * share // 2 : (r + 1) * share // 2].T)
    return partials, sum(partials)


def _mlp_down_by_rows(x, gate, up, down, tp):
    partials, _ = sol(7).tp_mlp(x, gate, up, down, tp)
    y = sum(partials)
    return [y / tp] * tp, y


def _merge_mean(out, lse):
    return out.where(torch.isfinite(lse).unsqueeze(-1), 0).sum(0) / torch.isfinite(lse).sum(
        0
    ).unsqueeze(-1)


def _merge_empty_weighs(out, lse):  # an empty piece (lse = -inf) read as lse = 0
    return sol(K).merge_splits(out, lse.nan_to_num(neginf=0.0))


def _merge_unnormalised(out, lse):
    w = torch.exp(lse - lse.max(0).values)
    return (w.unsqueeze(-1) * out.where(w.unsqueeze(-1) > 0, 0)).sum(0)


def _store_ignores_skip(key, value, k_cache, v_cache, slots):
    flat_k, flat_v = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots.long()], flat_v[slots.long()] = key, value  # slot -1 writes the last slot


def _store_ignores_strides(key, value, k_cache, v_cache, slots):
    n, h, d = key.shape
    key = torch.as_strided(key, (n, h, d), (h * d, d, 1))  # reads as if the keys were contiguous
    sol(K).store_kvcache(key.contiguous(), value, k_cache, v_cache, slots)


def _store_block_major(key, value, k_cache, v_cache, slots):
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_cache[s % k_cache.shape[0], s // k_cache.shape[0]] = key[t]
            v_cache[s % v_cache.shape[0], s // v_cache.shape[0]] = value[t]


def _accept_if_p_above_q(p, q, d, u, e):  # keeps d whenever p(d) >= q(d), never by chance
    return d if p[d] >= q[d] else int(((p - q).clamp(min=0) / e).argmax())


def _resample_from_p(
    p, q, d, u, e
):  # the rule right, the draw after a rejection from p, not (p - q)+
    return d if u < min(1.0, float(p[d] / q[d])) else int((p / e).argmax())


def _ngram_first_match(ids, k, low, high):  # the first earlier occurrence, not the last
    for n in range(min(high, len(ids) - 1), low - 1, -1):
        for start in range(len(ids) - n):
            if ids[start : start + n] == ids[-n:]:
                return ids[start + n : start + n + k]
    return []


def _ngram_shortest_first(ids, k, low, high):  # tries n = min_n first
    for n in range(low, min(high, len(ids) - 1) + 1):
        got = sol(S).ngram_propose(ids, k, n, n)
        if got:
            return got
    return []


def _rollback_frees_shared(
    table, counts, free, num_tokens, bs
):  # frees a block another sequence still reads
    keep = -(-num_tokens // bs)
    for b in table[keep:]:
        counts[b] -= 1
        free.append(b)
    del table[keep:]
    return (bs - num_tokens % bs) % bs


def _rollback_keeps_one_too_many(
    table, counts, free, num_tokens, bs
):  # num_tokens // bs + 1 blocks: one too many when full
    sol(S).rollback(table, counts, free, num_tokens + 1, bs)
    return (bs - num_tokens % bs) % bs


WRONG = {
    "naive_generate": [_naive_last_token_only, _naive_extra_call],
    "gumbel_max": [
        lambda l, t, u: torch.where(
            t == 0, l.argmax(-1), (_softmax(l, t) * u).argmax(-1)
        ),  # multiplies by the noise
        lambda l, t, u: torch.where(
            t == 0, l.argmax(-1), (_softmax(l, t) / u).argmax(-1)
        ),  # uniform, not Exp(1)
        lambda l, t, u: torch.where(
            t == 0, l.argmax(-1), (torch.softmax(l, -1) / -u.log()).argmax(-1)
        ),  # no T
        lambda l, t, u: (torch.softmax(l / t.unsqueeze(1), -1) / -u.log()).argmax(
            -1
        ),  # T = 0 divides by zero
        lambda l, t, u: sol(1).gumbel_max(l, t, torch.rand_like(u)),  # its own noise
        lambda l, t, u: l.argmax(-1),  # always greedy
    ],
    "route": [
        lambda l, k, r: sol(1).route(l, k, False),  # forgets to renormalise
        lambda l, k, r: sol(1).route(l, k, True),  # renormalises also when norm_topk_prob is false
        _route_softmax_after_topk,
        _route_softmax_over_tokens,
        _route_topk_over_tokens,
        lambda l, k, r: sol(1).route(l.float(), k, r),
    ],  # float32 weights for bfloat16 logits
    "expert_load": [
        lambda ids, e: torch.bincount(
            ids.flatten()
        ),  # no minlength: the unpicked last experts vanish
        lambda ids, e: torch.bincount(ids[:, 0], minlength=e),  # counts first choices only
        lambda ids, e: torch.zeros(e).index_add_(0, ids.flatten(), torch.ones(ids.numel())),
    ],  # floats
    "step_inputs": [
        _slots_no_cache,
        _slots_ignore_row,
        lambda t, c, r, L: (lambda a, p, s: (a, list(range(len(a))), s))(
            *sol(2).step_inputs(t, c, r, L)
        ),
    ],
    "attend_cached": [_attend_no_write, _attend_not_causal, _attend_gqa_repeat],
    "slot_mapping": [
        lambda bt, s, e, bs: [bt[p // bs] + p % bs for p in range(s, e)],  # forgets * block_size
        lambda bt, s, e, bs: list(range(s, e)),  # ignores the block table
        lambda bt, s, e, bs: sol(3).slot_mapping(bt, 0, e, bs),
    ],  # every position, every step
    "gather_kv": [_gather_flat, _gather_floor],
    "prefix_hashes": [
        lambda t, bs: [
            _bh(t[s : s + bs], -1) for s in range(0, len(t) - bs + 1, bs)
        ],  # not chained
        lambda t, bs: sol(4).prefix_hashes(t + [0] * (-len(t) % bs), bs),
    ],  # hashes the partial block
    "cached_blocks": [_cached_with_last_block, _cached_unconfirmed, _cached_unchained],
    "plan_step": [_plan_waiting_first, _plan_no_budget_cap, _plan_no_seat_limit],
    "document_chunks": [lambda p, d, b: sol(5).document_chunks(p, 0, b), lambda p, d, b: [p]],
    "graph_batch_sizes": [
        lambda m: [1, 2, 4, 8] + list(range(16, m + 1, 16)),  # too many small sizes
        lambda m: sorted(
            {x for x in [1, 2, 4, 8, *range(16, m + 1, 16)] if x <= m} | {m}
        ),  # no cap
        lambda m: [x for x in [1, 2, 4, 8, *range(16, min(m, 512) + 1, 16)] if x <= m],
    ],  # no top
    "pad_for_graph": [
        lambda s, l, z: _pad(s, l, z, z[-1], -1, 0),  # always the largest graph
        lambda s, l, z: _pad(s, l, z, _next_size(s, z), 0, 0),  # padding writes slot 0
        lambda s, l, z: _pad(s, l, z, _next_size(s, z), -1, 1),
    ],  # padding attends to a token
    "row_parallel_linear": [
        _row_parallel_bias_everywhere,
        _row_parallel_concatenated,
        _row_parallel_split_outputs,
    ],
    "qkv_rows": [
        lambda h, kv, d, r, tp: list(
            range(r * (h + 2 * kv) * d // tp, (r + 1) * (h + 2 * kv) * d // tp)
        )
    ],
    "filter_probs": [
        _filter_unnormalised,
        _filter_p_inclusive,
        _filter_min_p_absolute,
        _filter_k0_keeps_none,
        lambda l, t, k, p, m: sol(1).filter_probs(l, torch.ones_like(t), k, p, m),
    ],  # forgets T
    "static_scheduler": [_ContinuousRows, _NoCacheBookkeeping, _NoLengthLimit],
    "block_manager": [_LifoFree, _Leaks, _AlwaysRoom],
    "prefix_block_manager": [_NoEviction, _NoRefCounts, _ForgetsOnFree],
    "schedule": [_schedule_waiting_first, _schedule_no_chunks, _schedule_preempts_oldest],
    "replay": [_replay_no_padding, _replay_largest, _replay_uncounted, _replay_no_tables],
    "tp_mlp": [_mlp_fused_rows, _mlp_down_by_rows],
    "merge_splits": [_merge_mean, _merge_empty_weighs, _merge_unnormalised],
    "store_kvcache": [_store_ignores_skip, _store_ignores_strides, _store_block_major],
    "prefill_key_tiles": [
        lambda q, c, t, bm, bn: (
            c - q + t * bm,
            min(c, c - q + (t + 1) * bm),
        ),  # not whole key tiles
        lambda q, c, t, bm, bn: (
            t * bm // bn * bn,
            min(c, (t + 1) * bm),
        ),  # forgets the cached prefix
        lambda q, c, t, bm, bn: (
            (c - q + t * bm) // bn * bn,
            c,
        ),  # reads every key up to the context's end
        lambda q, c, t, bm, bn: (
            ((c - q + t * bm) // bn + 1) * bn,
            min(c, c - q + (t + 1) * bm),
        ),  # a tile too far
        lambda q, c, t, bm, bn: (
            0,
            min(c, c - q + (t + 1) * bm),
        ),  # masks everything: right, but slow
    ],
    "quantize_kv": [
        lambda x, s: (
            (x.float() * s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        ),  # multiplies by the scale
        lambda x, s: (
            (x.float() / s.max()).clamp(-448, 448).to(torch.float8_e4m3fn)
        ),  # one scale for all heads
        lambda x, s: (
            (x.float() / s[:, None]).clamp(-448, 448).to(torch.float8_e5m2)
        ),  # the other fp8 format
    ],
    "accept_or_resample": [
        _accept_if_p_above_q,
        _resample_from_p,
        lambda p, q, d, u, e: d,  # always accepts: the draft's distribution
        lambda p, q, d, u, e: d if u < float(p[d]) else int((p / e).argmax()),
    ],  # ignores q
    "ngram_propose": [
        _ngram_first_match,
        _ngram_shortest_first,
        lambda ids, k, low, high: sol(S).ngram_propose(ids, k - 1, low, high) if k > 1 else [],
    ],  # k - 1
    "rollback": [
        _rollback_frees_shared,
        _rollback_keeps_one_too_many,
        lambda t, c, f, n, bs: (sol(S).rollback(t, c, f, n, bs), bs - n % bs)[1],
    ],  # bs left when full
}

WRONG_CASES = [(n, name, i) for n, name in CHECKS for i in range(len(WRONG[name]))]


@pytest.mark.parametrize(
    "n, name, i", WRONG_CASES, ids=[f"{_name(n)}-{name}-{i}" for n, name, i in WRONG_CASES]
)
def test_check_fails_on_a_wrong_answer(n, name, i):
    with pytest.raises(ExerciseFailed) as failure:
        getattr(ex(n), f"check_{name}")(WRONG[name][i])
    message = str(failure.value)
    assert len(message) > 20
    assert failure.value._render_traceback_()[0].endswith(
        message.splitlines()[0]
    )  # shown without a traceback


# ---- the notebook helper ----


def stub(*args):
    raise NotImplementedError


def test_run_shows_the_reference_with_a_verdict_of_its_own(capsys, monkeypatch):
    monkeypatch.delenv("EXERCISES_STRICT", raising=False)
    used = exercises.run(ex(6).check_graph_batch_sizes, stub)
    assert used is sol(6).graph_batch_sizes
    out = capsys.readouterr().out
    assert "not written yet \N{EM DASH} reference shown" in out and "solutions/ex06.py" in out
    assert "\N{CHECK MARK}" not in out  # an unwritten exercise never gets the tick of a pass
    assert out.startswith(exercises.report.NOT_WRITTEN)


def test_run_on_an_unwritten_class(capsys, monkeypatch):
    monkeypatch.delenv("EXERCISES_STRICT", raising=False)

    class BlockManager:
        def __init__(self, num_blocks, block_size):
            raise NotImplementedError

    assert exercises.run(ex(3).check_block_manager, BlockManager) is sol(3).BlockManager
    assert "\N{CHECK MARK}" not in capsys.readouterr().out


def test_run_strict_mode_fails_on_a_stub(monkeypatch):
    monkeypatch.setenv("EXERCISES_STRICT", "1")
    with pytest.raises(ExerciseFailed, match="not written yet"):
        exercises.run(ex(6).check_graph_batch_sizes, stub)


def test_run_returns_a_passing_function_and_stops_on_a_wrong_one(capsys):
    def graph_batch_sizes(m):
        return sol(6).graph_batch_sizes(m)

    assert exercises.run(ex(6).check_graph_batch_sizes, graph_batch_sizes) is graph_batch_sizes
    assert "\N{CHECK MARK} graph_batch_sizes" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed, match="max num seqs"):
        exercises.run(ex(6).check_graph_batch_sizes, WRONG["graph_batch_sizes"][0])


# ---- the instructor's guide keeps up with the notebooks ----


def test_the_instructors_guide_covers_every_notebook_and_exercise():
    import re
    from pathlib import Path

    root = Path(exercises.__file__).resolve().parent.parent
    guide = (root / "INSTRUCTORS.md").read_text(encoding="utf-8")
    quiz = guide.split("## Quiz questions", 1)[1].split("\n## ", 1)[0]
    sections = dict(re.findall(r"^### (.+?)\n(.*?)(?=^### |\Z)", quiz, re.S | re.M))
    syllabus = re.findall(
        r"^\| \[([^\]]+)\]\(([^)]+\.ipynb)\)", (root / "README.md").read_text(), re.M
    )
    for title, notebook in syllabus:
        assert notebook in guide.split("## The capstone", 1)[0], (
            f"the session plan has no session for {notebook}"
        )
        questions = re.findall(r"^\d+\. ", sections.get(title, ""), re.M)
        assert len(questions) >= 3, (
            f"the quiz has {len(questions)} questions for {title!r} (at least 3)"
        )
    for n, name in CHECKS:
        assert f"`{name}`" in guide.split("## The capstone", 1)[0], (
            f"the session plan never sets {name} ({_name(n)})"
        )
