"""The sampler's kernels in Triton. Reference: layers/sampler.py (keyed_exponential,
top_candidates, and Sampler.forward's PyTorch draws); tests/test_fused_kernels.py checks
these against it under TRITON_INTERPRET=1.

Temperature-only Gumbel-max: one pass over the logits and a small combining launch, for three
elementwise passes over the logits' shape, two argmaxes and a select; each row's top-k
candidates (its k largest logits), two launches for five; and the draw among them (softmax,
top-k / top-p / min-p masks, Gumbel-max), one launch for about twenty. Both draws hash each
token's Exp(1) noise from a key per row in registers."""

import torch
import triton
import triton.language as tl

from .common import warps
from .launch import pdl_args, wait_for_prior_kernel

# ---------------------------------------------------------------------------------------
# The sampler's noise: each token's Exp(1) value hashed from its row's key and its token id
# ---------------------------------------------------------------------------------------


@triton.jit
def _mix32(h):
    """sampler._mix32 on uint32 (MurmurHash3's finaliser; the products wrap mod 2**32)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _keyed_exponential(key, token_ids):
    """sampler.keyed_exponential in registers: a row's key (int64 in [0, 2**32)) and token
    ids [BLOCK] -> their Exp(1) noise [BLOCK] float32, the same bits as the PyTorch code."""
    k = key.to(tl.uint32)
    h = _mix32(_mix32(k ^ (token_ids.to(tl.uint32) * 0x27D4EB2F)) ^ k)
    u = tl.minimum(
        ((h >> 8).to(tl.float32) + 0.5) * (2.0**-24), 1 - 2.0**-24
    )  # uniform in (0, 1), never 1
    return -tl.log(u)


# ---------------------------------------------------------------------------------------
# The sampler's temperature-only draw: Gumbel-max argmax(logits / T - log E), and the
# greedy argmax of the rows at T = 0, in one pass over the logits
# ---------------------------------------------------------------------------------------


@triton.jit
def _gumbel_argmax_chunk_kernel(
    logits_ptr,
    key_ptr,
    temp_ptr,
    best_ptr,
    best_id_ptr,
    stride_l,
    V,
    CHUNKS,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """The maximum and its first index in one chunk of a row: of the logits in a greedy row
    (T = 0), of the Gumbel-max score in the others (only they hash noise)."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < V
    logit = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(
        tl.float32
    )
    t = tl.load(temp_ptr + row)
    if t == 0:
        best, best_i = tl.max(
            logit, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
    else:
        e = _keyed_exponential(tl.load(key_ptr + row), offs)
        # float32 as the reference computes it: the logit widened, an IEEE division, libdevice's log
        score = tl.div_rn(logit, tl.maximum(t, 1e-5)) - tl.log(
            e
        )  # -inf in the masked lanes; T clamped as by_temperature
        best, best_i = tl.max(
            score, axis=0, return_indices=True, return_indices_tie_break_left=True
        )
    out = row * CHUNKS + chunk
    tl.store(best_ptr + out, best)
    tl.store(best_id_ptr + out, chunk * BLOCK + best_i.to(tl.int64))


@triton.jit
def _gumbel_argmax_combine_kernel(
    best_ptr, best_id_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr, PDL: tl.constexpr
):
    """The id of a row's largest chunk maximum: the first chunk's on a tie, as argmax's."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    v = tl.load(best_ptr + row * CHUNKS + offs, mask=offs < CHUNKS, other=float("-inf"))
    _, c = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(best_id_ptr + row * CHUNKS + c))


def gumbel_argmax(
    logits: torch.Tensor,  # (rows, vocab), any float dtype, last dim contiguous
    keys: torch.Tensor,  # (rows,) int64 in [0, 2**32): each row's noise key
    temperatures: torch.Tensor,  # (rows,) float32, 0 = greedy
) -> torch.Tensor:  # (rows,) int64
    """argmax(logits / max(T, 1e-5) - log(noise)) per row with noise =
    sampler.keyed_exponential(keys, token ids), argmax(logits) where T = 0 (the first index on a
    tie, as torch.argmax): the Sampler's temperature-only draw, in two launches, reading the
    logits only."""
    rows, vocab = logits.shape
    assert keys.shape == (rows,) and keys.dtype == torch.int64 and temperatures.shape == (rows,)
    assert logits.stride(-1) == 1 and temperatures.dtype == torch.float32
    block = min(4096, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows > 0:
        temperatures = temperatures.contiguous()
        # fmt: off
        _gumbel_argmax_chunk_kernel[(rows, chunks)](
            logits, keys.contiguous(), temperatures, best, best_id, logits.stride(0), vocab, chunks,
            BLOCK=block, num_warps=warps(block), **pdl_args(logits.device),
        )
        _gumbel_argmax_combine_kernel[(rows,)](
            best, best_id, out, chunks, BLOCK_C=triton.next_power_of_2(chunks), num_warps=1,
            **pdl_args(logits.device),
        )
        # fmt: on
    return out


# ---------------------------------------------------------------------------------------
# The sampler's candidates: each row's k largest logits (sampler.top_candidates)
# ---------------------------------------------------------------------------------------

_REMOVED = tl.constexpr(-(2**31))  # an order key below every float's (_order_key): taken or padding


@triton.jit
def _order_key(x):
    """float32 x as int32 keys in the same order (-inf < finite < +inf < positive NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """_order_key's inverse."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _group_max_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    num_groups,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[row, g] = max of logits g * GROUP .. (g + 1) * GROUP - 1, for BLOCK_G groups a program."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    ok = groups < num_groups
    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP]
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok[:, None], other=float("-inf"))
    tl.store(
        out_ptr + row.to(tl.int64) * num_groups + groups, tl.max(x, axis=1).to(tl.float32), mask=ok
    )


@triton.jit
def _top_groups_kernel(
    x_ptr,
    maxima_ptr,
    values_ptr,
    ids_ptr,
    stride_x,
    num_groups,
    k,
    GROUP: tl.constexpr,
    BLOCK_NG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per row: the k groups of largest maxima, then the k largest logits among those groups'
    k * GROUP, largest first (an argmax taken out k times, over order keys)."""
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, BLOCK_NG)  # [BLOCK_NG]
    keys = tl.load(maxima_ptr + row * num_groups + offs_g, mask=offs_g < num_groups, other=0.0)
    keys = tl.where(offs_g < num_groups, _order_key(keys), _REMOVED)
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top = tl.zeros([BLOCK_K], tl.int32)  # the groups taken, in order
    for i in range(0, k):
        best = tl.argmax(keys, axis=0)
        top = tl.where(offs_k == i, best, top)
        keys = tl.where(offs_g == best, _REMOVED, keys)
    ids = top[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_K, GROUP] token ids
    taken = (offs_k < k)[:, None]
    x = tl.load(x_ptr + row * stride_x + ids, mask=taken, other=0.0).to(tl.float32)
    keys = tl.where(taken, _order_key(x), _REMOVED)  # [BLOCK_K, GROUP]
    flat = (
        offs_k[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    )  # [BLOCK_K, GROUP]: each candidate's place
    for i in range(0, k):
        key = tl.max(tl.max(keys, axis=1), axis=0)
        place = tl.min(
            tl.min(tl.where(keys == key, flat, BLOCK_K * GROUP), axis=1), axis=0
        )  # the first holding it
        tl.store(values_ptr + row * k + i, _key_value(key).to(values_ptr.dtype.element_ty))
        tl.store(
            ids_ptr + row * k + i,
            tl.sum(tl.sum(tl.where(flat == place, ids, 0), axis=1), axis=0).to(tl.int64),
        )
        keys = tl.where(flat == place, _REMOVED, keys)


def top_candidates(logits: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sampler.top_candidates' grouped pass in two launches (for its five): the maxima of the
    groups of `group` logits, then per row the top k of the k groups of largest maxima. Values
    (rows, k) in logits' dtype, largest first, and their ids (rows, k) int64 (equal values: any)."""
    rows, vocab = logits.shape
    assert vocab % group == 0 and k * group <= vocab and logits.stride(-1) == 1
    num_groups = vocab // group
    values = torch.empty(rows, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    if rows == 0 or k == 0:
        return values, ids
    maxima = torch.empty(rows, num_groups, dtype=torch.float32, device=logits.device)
    block_g = max(1, 4096 // group)
    # fmt: off
    _group_max_kernel[(rows, triton.cdiv(num_groups, block_g))](
        logits, maxima, logits.stride(0), num_groups, GROUP=group, BLOCK_G=block_g, num_warps=4,
        **pdl_args(logits.device),
    )
    # fmt: on
    block_k = triton.next_power_of_2(k)
    # fmt: off
    _top_groups_kernel[(rows,)](
        logits, maxima, values, ids, logits.stride(0), num_groups, k, GROUP=group,
        BLOCK_NG=triton.next_power_of_2(num_groups), BLOCK_K=block_k,
        num_warps=warps(block_k * group), **pdl_args(logits.device),
    )
    # fmt: on
    return values, ids


# ---------------------------------------------------------------------------------------
# The sampler's draw among each row's top-k candidates: temperature, softmax, the top-k /
# top-p / min-p masks and Gumbel-max, in one launch (one program per row)
# ---------------------------------------------------------------------------------------


@triton.jit
def _candidates_draw_kernel(
    values_ptr,
    ids_ptr,
    key_ptr,
    temp_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    out_ptr,
    stride_v,
    stride_i,
    K,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # [BLOCK]: the candidates, most likely first
    valid = offs < K
    x = tl.load(values_ptr + row * stride_v + offs, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.div_rn(x, tl.maximum(tl.load(temp_ptr + row), 1e-5))  # sampler.by_temperature
    e = tl.exp(x - tl.max(x, axis=0))  # 0 in the masked lanes
    p = tl.div_rn(e, tl.sum(e, axis=0))  # softmax over the candidates
    keep = valid
    kept = p  # sampler.keep_sorted's sorted_p
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        keep = keep & (offs < tl.where(k > 0, k, K))
        kept = tl.where(keep, p, 0.0)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        before = tl.cumsum(kept, axis=0) - kept  # the mass of the more likely candidates
        bound = tl.where(
            top_p >= 1, float("inf"), top_p * tl.sum(kept, axis=0)
        )  # top_p 1: keep all
        keep = keep & (before < bound)
    if HAS_MIN_P:
        keep = keep & (p >= tl.load(min_p_ptr + row) * tl.max(p, axis=0))
    ids = tl.load(ids_ptr + row * stride_i + offs, mask=valid, other=0)
    noise = _keyed_exponential(tl.load(key_ptr + row), ids)
    score = tl.div_rn(tl.where(keep, p, 0.0), noise)  # Gumbel-max: argmax(p / E)
    _, choice = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(ids_ptr + row * stride_i + choice).to(tl.int64))


def candidates_draw(
    values: torch.Tensor,  # (rows, k) each row's k largest logits, largest first, any float dtype
    ids: torch.Tensor,  # (rows, k) int64: their token ids
    keys: torch.Tensor,  # (rows,) int64 in [0, 2**32): each row's noise key
    temperatures: torch.Tensor,  # (rows,) float32
    top_k: torch.Tensor | None = None,  # (rows,) int, 1..k (0 = all k)
    top_p: torch.Tensor | None = None,  # (rows,) float32, 1 = off
    min_p: torch.Tensor | None = None,  # (rows,) float32, 0 = off
) -> torch.Tensor:  # (rows,) int64 token ids
    """The Sampler's draw over the candidates (its `max_k` path, greedy rows aside): softmax of
    values / T, keep_sorted's top-k and top-p, min-p against the most likely, then the id of
    argmax(p / noise) with noise = sampler.keyed_exponential(keys, ids), the first on a tie as
    torch.argmax's. One launch for the ~20 that the PyTorch code takes."""
    rows, k = values.shape
    assert (
        ids.shape == (rows, k)
        and keys.shape == (rows,)
        and keys.dtype == torch.int64
        and temperatures.shape == (rows,)
    )
    assert values.stride(-1) == 1 and ids.stride(-1) == 1 and temperatures.dtype == torch.float32
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows > 0:
        unused = temperatures  # any pointer stands in for an absent mask (never read)
        block = max(16, triton.next_power_of_2(k))
        # fmt: off
        _candidates_draw_kernel[(rows,)](
            values, ids, keys.contiguous(), temperatures.contiguous(),
            unused if top_k is None else top_k.contiguous(),
            unused if top_p is None else top_p.contiguous(),
            unused if min_p is None else min_p.contiguous(), out, values.stride(0), ids.stride(0),
            k, HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None,
            HAS_MIN_P=min_p is not None, BLOCK=block, num_warps=warps(block),
            **pdl_args(values.device),
        )
        # fmt: on
    return out
