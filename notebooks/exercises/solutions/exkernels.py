"""Reference solutions for kernels.ipynb. Import after setting TRITON_INTERPRET=1 on a CPU."""

import torch
import triton
import triton.language as tl


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    # part_out: (splits, heads, d), each piece normalised on its own; part_lse: (splits, heads)
    top = part_lse.max(dim=0).values  # (heads,): subtract it so that exp never overflows
    w = torch.exp(part_lse - top)  # (splits, heads): each piece's mass, relative; 0 for an empty piece
    merged = (w.unsqueeze(-1) * torch.where(w.unsqueeze(-1) > 0, part_out, 0.0)).sum(0)  # (heads, d)
    return merged / w.sum(0).unsqueeze(-1)


@triton.jit
def _store_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                  KVH: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)  # one program per token
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding: nothing to store
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    mask = (h < KVH) & (d < D)
    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)  # [BLOCK_H, BLOCK_D]
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * (KVH * D) + h * D + d  # the cache is contiguous: slot s starts at s * kv_heads * head_dim
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(key, value, k_cache, v_cache, slot_mapping) -> None:
    tokens, kv_heads, d = key.shape  # key, value: (tokens, kv_heads, d), last dim contiguous
    _store_kernel[(tokens,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0), key.stride(1),
                             value.stride(0), value.stride(1), KVH=kv_heads, D=d,
                             BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(d))


def prefill_key_tiles(q_len: int, context_len: int, tile_m: int, BLOCK_M: int, BLOCK_N: int) -> tuple[int, int]:
    prefix = context_len - q_len  # cached tokens before the first new one
    first_q = prefix + tile_m * BLOCK_M  # the tile's first query: every key before it is visible to all
    full_end = first_q // BLOCK_N * BLOCK_N  # whole key tiles only
    kv_end = min(context_len, prefix + (tile_m + 1) * BLOCK_M)  # one past the tile's last query
    return full_end, kv_end


FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x: (..., kv_heads, head_dim); scale: (kv_heads,) -> one scale per kv head, broadcast over head_dim
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
