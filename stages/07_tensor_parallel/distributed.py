"""NEW in 07_tensor_parallel: tensor parallelism's process group, in one place: this
process's rank, joining and leaving the group, and the collectives the layers and the
engine use.

Every rank runs the same model code on its own shard of the weights. A layer asks
`get_tp_rank()` / `get_tp_size()` once, when it is built, to size its shard;
`init_tensor_parallel` sets them (and `set_tp_rank` for a model built without a group).
In forward, a layer whose size is above 1 calls `all_reduce` / `gather_to_first` over
torch.distributed's default group. With one rank there is no process group at all and
no layer communicates.

Leaving the group. NCCL will not free a communicator while a CUDA graph that captured one
of its kernels is alive: ncclCommFinalize and ncclCommAbort both wait until every such
graph is destroyed. So the model runner hands its graphs to `keep_graphs`, and leaving
(`destroy_tensor_parallel`) or aborting (`abort_tensor_parallel`) drops them first."""

import datetime
import os
import threading

import torch
import torch.distributed as dist

_rank, _size = 0, 1  # the shard that layers built from now on take
_owned = False  # did we create torch.distributed's default group (so that we may destroy it)?
_graph_holders: list[dict] = []  # dicts of CUDA graphs that captured this group's collectives


def get_tp_rank() -> int:
    return _rank


def get_tp_size() -> int:
    return _size


def set_tp_rank(rank: int, size: int) -> None:
    global _rank, _size
    _rank, _size = rank, size


def divide(n: int, what: str) -> int:
    """Each rank's equal share of `n` (the engine checks divisibility up front; this is a guard)."""
    if n % _size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={_size}")
    return n // _size


# ---- the group's lifecycle ----


def require_no_process_group() -> None:
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process (is another tensor-parallel LLM "
            "still running?); call its shutdown(), or use `with LLM(...)`, before starting another"
        )


def init_tensor_parallel(
    rank: int, size: int, backend: str, init_method: str, timeout_s: float
) -> None:
    """Join the group: blocks until all `size` ranks have called it with the same `init_method`.
    `timeout_s` bounds the rendezvous and each collective (a live but stuck peer)."""
    global _owned
    require_no_process_group()
    if (
        backend == "nccl"
    ):  # on a failed or timed-out collective, abort the group but never kill this process
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    _owned = True
    set_tp_rank(rank, size)


def keep_graphs(graphs: dict) -> None:
    """`graphs` holds CUDA graphs that capture this group's collectives: leaving the group
    empties it first (NCCL waits for those graphs to die before it lets a communicator go)."""
    _graph_holders.append(graphs)


def release_graphs() -> None:
    """Drop every CUDA graph that captured a collective. A graph still replaying is freed by
    CUDA when its launch completes."""
    for graphs in _graph_holders:
        graphs.clear()


def destroy_tensor_parallel() -> None:
    """Leave the group, together with the other ranks (each waits for the others to leave
    too). Idempotent; a group that someone else created is left alone."""
    global _owned
    release_graphs()
    _graph_holders.clear()
    if _owned and dist.is_initialized():
        dist.destroy_process_group()
    _owned = False
    set_tp_rank(0, 1)


def abort_tensor_parallel() -> None:
    """Abandon the group now, when a peer is gone: NCCL kernels waiting for it return at once
    (their output is garbage) and every collective after this one raises. gloo needs none of
    this: its sockets see the peer die, and destroying its group waits for nobody.

    ncclCommAbort first raises the kernels' abort flag, then frees the communicator, which
    waits for the CUDA graphs that captured its kernels to die. So the graphs are dropped
    first, and again while the abort runs in its own thread (one captured meanwhile; a graph
    that another thread is replaying dies when that replay call returns). torch's abort is
    private API."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if not (
        _owned and dist.is_initialized() and dist.get_backend() == "nccl" and abort is not None
    ):
        return
    release_graphs()

    def run() -> None:
        try:
            abort()
        except Exception:  # already gone (another thread left the group first)
            pass

    aborting = threading.Thread(target=run, name="tp-abort", daemon=True)
    try:
        aborting.start()
    except RuntimeError:  # at interpreter shutdown: no new threads, and no replay running either
        return run()
    while aborting.is_alive():
        aborting.join(0.05)
        release_graphs()


# ---- collectives ----


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest `value` any rank holds (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the total."""
    dist.all_reduce(x)
    return x


def gather_to_first(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's `x` along the last dimension on rank 0; the others get None."""
    x = x.contiguous()
    first = dist.get_rank() == 0
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())] if first else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if first else None
