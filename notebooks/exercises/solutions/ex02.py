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


class StaticBatchScheduler:
    """Static batching: admit up to max_num_seqs requests, run them until all have finished."""

    def __init__(self, max_num_seqs: int, max_model_len: int, eos_token_ids: list[int]):
        from collections import deque

        self.max_num_seqs, self.max_model_len, self.eos_token_ids = max_num_seqs, max_model_len, set(eos_token_ids)
        self.waiting, self.running = deque(), []

    def add(self, seq) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> list:
        if all(seq.is_finished for seq in self.running):  # the batch is done (or there is none): a new one
            self.running = []
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting.popleft()
                seq.status = type(seq.status).RUNNING
                seq.cache_row = len(self.running)  # row i of the cache for the batch's i-th sequence
                self.running.append(seq)
        return [seq for seq in self.running if not seq.is_finished]

    def postprocess(self, seqs: list, token_ids: list[int]) -> list:
        finished = []
        for seq, token_id in zip(seqs, token_ids):
            seq.num_cached_tokens = len(seq)  # the step wrote K/V for every token so far
            seq.append_token(token_id)
            if ((not seq.ignore_eos and token_id in self.eos_token_ids) or seq.num_completion_tokens >= seq.max_tokens
                    or len(seq) >= self.max_model_len):
                seq.status = type(seq.status).FINISHED
                finished.append(seq)
        if all(seq.is_finished for seq in self.running):
            self.running = []  # the whole batch is done: its rows are free
        return finished
