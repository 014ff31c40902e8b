"""Statistics over several processes: which forward passes a process runs, and the process group.

``accelerate launch --num_processes P -m wavesurf.cli analyze ...`` (or ``torchrun``) starts P
processes with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` in the environment. Each process runs the
forward passes of the capture batches ``i`` with ``i % P == rank`` and accumulates their float64
moments; the accumulators are then summed across processes (``all_reduce``: gloo on CPU, NCCL on
GPUs) and one process writes the cache. A quantile token filter needs the entropies of the first
``pilot_tokens`` positions before anything is kept, so every process runs those first batches
(a few thousand tokens), keeps only its own, and the threshold is the one a single process finds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import DistributedError



@dataclass
class Shard:
    """This process's share of the capture batches (``rank`` of ``world``)."""

    rank: int = 0
    world: int = 1
    #: while False, every process also runs batches it does not own (the quantile-filter pilot)
    pilot_done: bool = True

    def owns(self, batch_index: int) -> bool:
        return batch_index % self.world == self.rank

    def wants(self, batch_index: int) -> bool:
        """Whether this process runs the forward pass of batch ``batch_index``."""
        return self.owns(batch_index) or not self.pilot_done

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise DistributedError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is not an integer") from None


def init_from_env(device: str = "cpu") -> Shard:
    """The shard of this process: ``Shard()`` for a single process, else a process group set up
    from the launcher's environment (gloo for CPU, NCCL for CUDA), created once."""
    world = env_world_size()
    if world <= 1:
        return Shard()
    import torch.distributed as dist

    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise DistributedError(f"WORLD_SIZE={world} but {var} is not set; start the processes with "
                                   "`accelerate launch --num_processes P -m wavesurf.cli ...` or torchrun")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if str(device).startswith("cuda") else "gloo")
    return Shard(rank=dist.get_rank(), world=dist.get_world_size())


def local_threads() -> int | None:
    """CPU threads per process when several processes share one machine (None: not launched)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None or env_world_size() <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // max(1, int(local)))


def all_reduce_sum(tensor):
    """Sum ``tensor`` over all processes, in place (a no-op for one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_ints(*values: int) -> list[int]:
    import torch

    t = all_reduce_sum(torch.tensor([int(v) for v in values], dtype=torch.int64, device=collective_device()))
    return [int(v) for v in t.cpu().tolist()]


def broadcast_(tensor, src: int):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src=src)
    return tensor


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def collective_device():
    """Tensors for NCCL collectives must live on the GPU; gloo takes CPU tensors."""
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_into_(tensor) -> None:
    """Sum a (CPU or GPU) tensor over all processes in place, moving it to the backend's device and back."""
    dev = collective_device()
    if tensor.device == dev:
        all_reduce_sum(tensor)
        return
    t = tensor.to(dev)
    all_reduce_sum(t)
    tensor.copy_(t)


__all__ = ["DistributedError", "Shard", "all_reduce_into_", "all_reduce_ints", "all_reduce_sum", "barrier",
           "broadcast_", "collective_device", "env_world_size", "init_from_env", "local_threads", "world"]
