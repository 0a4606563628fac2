"""The notebooks' exercises: every check passes on its reference solution and fails, with an
ExerciseFailed that says what is wrong, on planted wrong answers (at least one per check)."""

import importlib

import pytest
import torch
import torch.nn.functional as F

exercises = importlib.import_module("notebooks.exercises")
ExerciseFailed = exercises.ExerciseFailed


def ex(n: int):
    return importlib.import_module(f"notebooks.exercises.ex{n:02d}")


def sol(n: int):
    return importlib.import_module(f"notebooks.exercises.solutions.ex{n:02d}")


CHECKS = [(1, "naive_generate"), (1, "gumbel_max"), (2, "step_inputs"), (2, "attend_cached"), (3, "slot_mapping"),
          (3, "gather_kv"), (4, "prefix_hashes"), (4, "cached_blocks"), (5, "plan_step"), (5, "document_chunks"),
          (6, "graph_batch_sizes"), (6, "pad_for_graph"), (7, "row_parallel_linear"), (7, "qkv_rows")]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only cost time on a busy machine
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n, name", CHECKS, ids=[f"ex{n:02d}-{name}" for n, name in CHECKS])
def test_reference_solution_passes(n, name):
    summary = getattr(ex(n), f"check_{name}")(getattr(sol(n), name))
    assert isinstance(summary, str) and summary


def test_every_notebook_exercise_is_listed():
    for n in range(1, 8):
        checks = {k.removeprefix("check_") for k in vars(ex(n)) if k.startswith("check_")}
        assert checks == {name for m, name in CHECKS if m == n}
        assert all(callable(getattr(sol(n), name)) for name in checks)


# ---- planted wrong answers: each one a mistake a learner could make ----


def _softmax(logits, t):
    return torch.softmax(logits / t.clamp(min=1e-5).unsqueeze(1), dim=-1)


def _naive_last_token_only(next_logits, prompt, n):  # feeds only the newest token: no cache, wrong tokens
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(next_logits(ids[-1:]).argmax()))
    return ids[len(prompt):]


def _naive_extra_call(next_logits, prompt, n):  # right tokens, one call too many
    out = sol(1).naive_generate(next_logits, prompt, n)
    next_logits(list(prompt) + out)
    return out


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
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k_row[: start + n].transpose(0, 1),
                                         v_row[: start + n].transpose(0, 1), enable_gqa=True)
    return out.transpose(0, 1)


def _attend_gqa_repeat(q, k, v, k_row, v_row, start):  # KV heads tiled (0, 1, 0, 1) instead of grouped
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
    return sol(4).cached_blocks(t, bs, hash_map, {b: t[i * bs : (i + 1) * bs] for i, b in enumerate(_chain_ids(t, bs, hash_map))})


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


WRONG = {
    "naive_generate": [_naive_last_token_only, _naive_extra_call],
    "gumbel_max": [
        lambda l, t, u: torch.where(t == 0, l.argmax(-1), (_softmax(l, t) * u).argmax(-1)),  # multiplies by the noise
        lambda l, t, u: torch.where(t == 0, l.argmax(-1), (_softmax(l, t) / u).argmax(-1)),  # uniform, not Exp(1)
        lambda l, t, u: torch.where(t == 0, l.argmax(-1), (torch.softmax(l, -1) / -u.log()).argmax(-1)),  # no T
        lambda l, t, u: (torch.softmax(l / t.unsqueeze(1), -1) / -u.log()).argmax(-1),  # T = 0 divides by zero
        lambda l, t, u: sol(1).gumbel_max(l, t, torch.rand_like(u)),  # its own noise
        lambda l, t, u: l.argmax(-1),  # always greedy
    ],
    "step_inputs": [_slots_no_cache, _slots_ignore_row,
                    lambda t, c, r, L: (lambda a, p, s: (a, list(range(len(a))), s))(*sol(2).step_inputs(t, c, r, L))],
    "attend_cached": [_attend_no_write, _attend_not_causal, _attend_gqa_repeat],
    "slot_mapping": [lambda bt, s, e, bs: [bt[p // bs] + p % bs for p in range(s, e)],  # forgets * block_size
                     lambda bt, s, e, bs: list(range(s, e)),  # ignores the block table
                     lambda bt, s, e, bs: sol(3).slot_mapping(bt, 0, e, bs)],  # every position, every step
    "gather_kv": [_gather_flat, _gather_floor],
    "prefix_hashes": [lambda t, bs: [_bh(t[s : s + bs], -1) for s in range(0, len(t) - bs + 1, bs)],  # not chained
                      lambda t, bs: sol(4).prefix_hashes(t + [0] * (-len(t) % bs), bs)],  # hashes the partial block
    "cached_blocks": [_cached_with_last_block, _cached_unconfirmed, _cached_unchained],
    "plan_step": [_plan_waiting_first, _plan_no_budget_cap, _plan_no_seat_limit],
    "document_chunks": [lambda p, d, b: sol(5).document_chunks(p, 0, b), lambda p, d, b: [p]],
    "graph_batch_sizes": [lambda m: [1, 2, 4, 8] + list(range(16, m + 1, 16)),  # too many small sizes
                          lambda m: sorted({x for x in [1, 2, 4, 8, *range(16, m + 1, 16)] if x <= m} | {m}),  # no cap
                          lambda m: [x for x in [1, 2, 4, 8, *range(16, min(m, 512) + 1, 16)] if x <= m]],  # no top
    "pad_for_graph": [lambda s, l, z: _pad(s, l, z, z[-1], -1, 0),  # always the largest graph
                      lambda s, l, z: _pad(s, l, z, _next_size(s, z), 0, 0),  # padding writes slot 0
                      lambda s, l, z: _pad(s, l, z, _next_size(s, z), -1, 1)],  # padding attends to a token
    "row_parallel_linear": [_row_parallel_bias_everywhere, _row_parallel_concatenated, _row_parallel_split_outputs],
    "qkv_rows": [lambda h, kv, d, r, tp: list(range(r * (h + 2 * kv) * d // tp, (r + 1) * (h + 2 * kv) * d // tp))],
}

WRONG_CASES = [(n, name, i) for n, name in CHECKS for i in range(len(WRONG[name]))]


@pytest.mark.parametrize("n, name, i", WRONG_CASES, ids=[f"ex{n:02d}-{name}-{i}" for n, name, i in WRONG_CASES])
def test_check_fails_on_a_wrong_answer(n, name, i):
    with pytest.raises(ExerciseFailed) as failure:
        getattr(ex(n), f"check_{name}")(WRONG[name][i])
    message = str(failure.value)
    assert len(message) > 20
    assert failure.value._render_traceback_()[0].endswith(message.splitlines()[0])  # shown without a traceback


# ---- the notebook helper ----


def stub(*args):
    raise NotImplementedError


def test_run_falls_back_to_the_solution_and_says_so(capsys, monkeypatch):
    monkeypatch.delenv("EXERCISES_STRICT", raising=False)
    used = exercises.run(ex(6).check_graph_batch_sizes, stub)
    assert used is sol(6).graph_batch_sizes
    out = capsys.readouterr().out
    assert "not written yet" in out and "solutions/ex06.py" in out and "\N{CHECK MARK}" in out


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
