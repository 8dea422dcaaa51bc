"""How the processes running one simulation combine their work: alone (one process), or over torch.distributed.

Every process of a run drives the same round loop in lockstep (same sampling, same strategy): each trains its
share of a round's clients, and what the round needs of all of them is combined here. Linear aggregates are
sums (``all_sum``, one collective per bucket of tensors); counts, records and client states are small Python
objects (``all_gather``); the run's starting point comes from the leading process (``broadcast``). The
aggregation's float64 sums travel as they are, so a run over N processes matches the one-process run to float
rounding of the sums' order.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

BUCKET_ELEMENTS = 1 << 24  # tensors summed per collective: 16M float64 = 128 MB held twice at most


class Collective:
    """One process alone: every combination is the identity. The base of :class:`TorchCollective`."""

    rank = 0
    world = 1

    @property
    def leads(self) -> bool:
        """Whether this process writes the run (metrics, checkpoints, plots): rank 0."""
        return self.rank == 0

    def all_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each tensor, in place, by its sum over the processes (same names, shapes, order everywhere)."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in rank order, handed to every process."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """The leading process's ``obj``, handed to every process (the others pass None)."""
        return obj

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Overwrite each tensor, in place, with the leading process's."""

    def close(self) -> None:
        """Leave the group."""


LOCAL = Collective()


class TorchCollective(Collective):
    """The processes of a ``torch.distributed`` group: gloo (the sums travel CPU-side) or NCCL (each process's
    own GPU; the CPU-side float64 sums go through it).

    ``timeout_s`` bounds every collective: a process that died or hangs makes the others fail after it
    rather than wait forever."""

    def __init__(self, rank: int, world: int, timeout_s: float, backend: str = "gloo") -> None:
        self.rank = rank
        self.world = world
        self.timeout = datetime.timedelta(seconds=timeout_s)
        # where the collectives' tensors must be: gloo moves CPU tensors, NCCL this process's GPU
        self.wire = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @classmethod
    def from_environment(cls, timeout_s: float, backend: str = "gloo") -> TorchCollective:
        """Join the group that ``torchrun`` (or ``fedlm run --workers``) described in RANK / WORLD_SIZE /
        MASTER_ADDR / MASTER_PORT, over ``backend`` (gloo, or nccl with this process's GPU already set)."""
        collective = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s, backend)
        if not dist.is_initialized():
            dist.init_process_group(backend, rank=collective.rank, world_size=collective.world,
                                    timeout=collective.timeout)
        return collective

    def all_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        for bucket in _buckets(tensors):
            if len(bucket) == 1 and bucket[0].device == self.wire:
                dist.all_reduce(bucket[0])
                continue
            flat = torch.cat([t.reshape(-1).to(self.wire) for t in bucket])
            dist.all_reduce(flat)
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()

    def all_gather(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.device == self.wire:
                dist.broadcast(tensor, src=0)
            else:  # through a copy where the backend can move it (gloo: a GPU worker's via the CPU)
                moved = tensor.detach().to(self.wire)
                dist.broadcast(moved, src=0)
                tensor.copy_(moved)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _buckets(tensors: Sequence[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, up to :data:`BUCKET_ELEMENTS` elements each (a bigger one alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if bucket and (size + tensor.numel() > BUCKET_ELEMENTS or tensor.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel()
    if bucket:
        yield bucket
