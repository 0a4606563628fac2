"""Reference solutions for 02_kvcache.ipynb."""

import torch


def step_inputs(token_ids: list[int], num_cached_tokens: int, cache_row: int, max_model_len: int):
    positions = list(range(num_cached_tokens, len(token_ids)))  # only the tokens not cached yet
    input_ids = token_ids[num_cached_tokens:]
    slots = [cache_row * max_model_len + p for p in positions]  # the row's slot for each position
    return input_ids, positions, slots


def attend_cached(q, k, v, k_row, v_row, start: int) -> torch.Tensor:
    # q: (n, heads, head_dim); k, v: (n, kv_heads, head_dim); k_row, v_row: (max_len, kv_heads, head_dim)
    n, heads, head_dim = q.shape
    k_row[start : start + n] = k  # write: the new tokens' K/V go to their positions
    v_row[start : start + n] = v
    keys, values = k_row[: start + n], v_row[: start + n]  # read: (length, kv_heads, head_dim)
    group = heads // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # (length, heads, head_dim): KV head h // group -> query head h
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * head_dim**-0.5  # (heads, n, length)
    q_pos = torch.arange(start, start + n)
    k_pos = torch.arange(start + n)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))  # causal
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values)  # (n, heads, head_dim)
