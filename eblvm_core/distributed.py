"""Data parallelism on torch.distributed, launched by torchrun: joining the process group,
averaging gradients over ranks for ``apply_update`` (bucketed), a differentiable mean for
gradients that are part of a later graph (an unrolled lower-level step), and the few
collectives the trainer needs.

Without a process group (a plain ``eblvm run``) every helper is the identity and costs one
``dist.is_initialized()`` check. With one, the helpers are collectives: every rank must call
them in the same order with tensors of the same shapes. ``docs/distributed.md`` says what holds
exactly and what in distribution.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from eblvm_core.rundir import STORE_FD

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size: a ResNet-18's float32 gradients travel in two all-reduces
TIMEOUT = datetime.timedelta(minutes=60)  # ranks > 0 wait this long for rank 0's evaluations and checkpoints
_local = False  # inside ``local()``: collectives off
_groups_torn_down = 0  # process groups this process has left
_joined = False  # whether ``process_group`` made this process a rank of a process group
_served_store: Any = None  # rank 0 of ``eblvm run --nproc-per-node``: the store it serves, kept while the process lives


def active() -> bool:
    """Whether collectives run: a process group exists and no ``local()`` block is open."""
    return not _local and dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the process group; 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of processes in the process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[torch.device]:
    """Under torchrun (``WORLD_SIZE`` in the environment) join the process group for the block on
    this rank's ``device`` (the plan's: cpu, or cuda:LOCAL_RANK): NCCL on a GPU, gloo on the CPU.
    Otherwise, or when a process group exists already, do nothing."""
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        yield device
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cuda = device.type == "cuda"
    serve_store()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT, device_id=device if cuda else None)
    global _joined
    _joined = True
    from eblvm_core.errors import TrainingDiverged

    try:
        yield device
    except BaseException as exc:
        if isinstance(exc, TrainingDiverged) and not cuda:  # every rank stops here together (the
            # NaN check is collective); bounded, so a rank that stopped alone still exits
            with contextlib.suppress(Exception):
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        dist.destroy_process_group()
        raise
    leave_process_group()


def serve_store() -> None:
    """Rank 0 of ``eblvm run --nproc-per-node`` (``STORE_FD`` in its environment): serve the
    rendezvous store on the socket the launcher bound and passed on. Every rank, this one too,
    then joins it as a client at MASTER_ADDR:MASTER_PORT, as under torchrun's agent. Elsewhere:
    nothing."""
    global _served_store
    fd = os.environ.pop(STORE_FD, None)  # popped: served once, and not inherited by a process this one starts
    if fd is None:
        return
    _served_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=int(fd),
        timeout=TIMEOUT,
    )


def was_a_rank() -> bool:
    """Whether this process was a rank of a process group it joined in ``process_group``. Such a
    process should end with ``os._exit`` once its output is flushed (``cli.main``): after a
    finished run, the interpreter's teardown can still abort in torch's C++ destructors
    ("terminate called without an active exception", exit -6) with no Python frame left."""
    return _joined


def leave_process_group() -> None:
    """Tear the default process group down on every rank together: every rank past its last
    collective before any tears the group down, and every group torn down before any rank exits.
    A rank that exits while a peer's gloo threads still talk to it can abort that peer
    ("terminate called without an active exception", exit -6). The rank that serves the store
    leaves last: a peer still asking the store when its host exits prints torch's "recvValue
    failed ... Connection reset by peer" warning with a C++ stack trace."""
    global _groups_torn_down
    store, world, host = dist.distributed_c10d._get_default_store(), dist.get_world_size(), hosts_store()
    dist.barrier()
    dist.destroy_process_group()
    _groups_torn_down += 1  # a key per group: every rank joins and leaves groups in the same order
    wait_for_all(store, f"eblvm/torn_down/{_groups_torn_down}", world)
    left = f"eblvm/left/{_groups_torn_down}"  # each peer's last call to the store
    if host:
        wait_for_all(store, left, world)
    else:
        with contextlib.suppress(Exception):
            store.add(left, 1)


def hosts_store() -> bool:
    """Whether the rendezvous store lives in this process: rank 0 of ``eblvm run --nproc-per-node``
    serves it (``serve_store``); rank 0 of ranks started without torchrun's agent store (the
    environment alone: MASTER_ADDR, RANK, ...) started it when it joined. Under torchrun the agent
    holds it."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # as torch reads it
    return _served_store is not None or (not agent and dist.get_rank() == 0)


def wait_for_all(store: Any, key: str, world: int, seconds: float = 30.0) -> None:
    """Count this rank in at ``key`` of the rendezvous store and wait (at most ``seconds``) until
    all ``world`` ranks have; a store that is gone (its host exited once all had counted) ends it."""
    deadline = time.monotonic() + seconds
    with contextlib.suppress(Exception):
        count = store.add(key, 1)
        while count < world and time.monotonic() < deadline:
            time.sleep(0.01)
            count = store.add(key, 0)


@contextlib.contextmanager
def local() -> Iterator[None]:
    """Collectives off within the block, for work one rank does alone (rank 0's evaluators):
    ``apply_update`` and ``mean_over_ranks`` then act on this rank's gradients only."""
    global _local
    saved, _local = _local, True
    try:
        yield
    finally:
        _local = saved


def buckets(tensors: Sequence[Tensor], cap: int = BUCKET_BYTES) -> list[list[Tensor]]:
    """Runs of consecutive tensors of one dtype and device holding about ``cap`` bytes each (a
    larger tensor travels alone)."""
    out: list[list[Tensor]] = []
    size, key = 0, None
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or (t.dtype, t.device) != key or size + nbytes > cap:
            out.append([])
            size, key = 0, (t.dtype, t.device)
        out[-1].append(t)
        size += nbytes
    return out


def average_gradients(grads: Sequence[Tensor], cap: int = BUCKET_BYTES) -> None:
    """Replace each tensor by its mean over ranks, in place: one all-reduce (sum, then ÷ W) per
    bucket of about ``cap`` bytes; NCCL queues them on its stream without a host
    synchronisation. Needs a process group."""
    world = dist.get_world_size()
    for bucket in buckets(grads, cap):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        parts = flat.div_(world).split([g.numel() for g in bucket])
        torch._foreach_copy_(bucket, [part.view_as(g) for part, g in zip(parts, bucket)])


class _SumOverRanks(torch.autograd.Function):
    """y = Σ_ranks x, differentiable any number of times: the gradient of every rank's x is the
    sum over ranks of the gradients of y (each rank's loss depends on every rank's x), itself
    this function; so a graph that uses y sends the same ∂/∂x back to every rank."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return _SumOverRanks.apply(grad)


def mean_over_ranks(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The mean over ranks of each tensor, differentiable: the backward pass all-reduces the
    incoming gradients too (``_SumOverRanks``). For gradients inside a later graph, e.g. an
    unrolled lower-level step φ − α·∂G/∂φ, so that ∂G/∂φ is the gradient of the union of the
    ranks' batches. ``list(tensors)`` without a process group or inside ``local()``."""
    if not active():
        return list(tensors)
    world = dist.get_world_size()
    out: list[Tensor] = []
    for bucket in buckets(tensors, cap=2**62):  # one all-reduce per dtype and device
        mean = _SumOverRanks.apply(torch.cat([t.reshape(-1) for t in bucket])) / world
        out += [part.view_as(t) for part, t in zip(mean.split([t.numel() for t in bucket]), bucket)]
    return out


def _device() -> torch.device:
    """Where this rank's collectives of small values live: NCCL needs the rank's CUDA device."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def mean_floats(values: list[float]) -> list[float]:
    """The mean over ranks of each value (one all-reduce); ``values`` without a process group."""
    if not active():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on some rank."""
    return mean_floats([float(flag)])[0] > 0


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` (picklable) on every rank; ``obj`` without a process group."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_device())
    return box[0]


@torch.no_grad()
def broadcast_(tensors: Sequence[Tensor]) -> None:
    """Overwrite each tensor with rank 0's, in place. Needs a process group."""
    for t in tensors:
        dist.broadcast(t.detach(), src=0)


def gather(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` (its tensors moved to the CPU first), as a list by rank on rank 0 and
    None on the others. Needs a process group."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(_to_cpu(obj), out, dst=0)
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s random streams, a function of (seed, rank) only (numpy's SeedSequence)."""
    return int(np.random.SeedSequence([seed % 2**63, rank]).generate_state(1, np.uint64)[0])
