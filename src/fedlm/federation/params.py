"""Named tensors: the currency of aggregation. Everything the server sees is a dict name -> tensor."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fedlm.federation.collective import Collective

NamedTensors = dict[str, torch.Tensor]


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of trainable parameters; tied weights appear once (named_parameters deduplicates)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def snapshot(model: torch.nn.Module, names: list[str] | None = None, *, copy: bool = True) -> NamedTensors:
    """Detached fp32 copies of the named parameters, on CPU (None -> every trainable parameter).

    ``copy=False`` returns a parameter that is already fp32 on the CPU as itself (detached, sharing its storage):
    valid only until the model changes, for a caller that reads it before then (a client's upload that the
    server folds before the next client trains: MiniLM's copy costs ~40 ms a client)."""
    params = dict(model.named_parameters())
    wanted = names if names is not None else trainable_names(model)
    cast = {n: params[n].detach().to("cpu", torch.float32) for n in wanted}
    if not copy:
        return cast
    return {n: t.clone() if t.data_ptr() == params[n].data_ptr() else t for n, t in cast.items()}


@torch.no_grad()
def load_into(model: torch.nn.Module, tensors: NamedTensors) -> None:
    """Copy named tensors into the model's parameters in place (names must exist)."""
    params = dict(model.named_parameters())
    for name, value in tensors.items():
        params[name].copy_(value.to(params[name].dtype))


def nbytes(tensors: NamedTensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def all_finite(tensors: NamedTensors) -> str | None:
    """The name of the first tensor holding NaN or Inf, or None if all are finite."""
    for name, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            return name
    return None


class RunningMean:
    """Per name, sum_i w_i x_i / sum_i w_i over the items holding that name, folded in one item at a time, so memory
    is one sum per name however many items come. Items may hold different names (clients that froze different
    blocks); a name whose items all weigh 0 has no mean.

    The sums are float64 and the mean is rounded to fp32 once: with example counts as weights every product and
    sum is exact, so the mean does not depend on the order items came in, one item's mean is the item, and
    equally weighted items give the same bits whatever the common weight."""

    CHUNK = 1 << 18  # float64 values converted at a time: 2 MB, reused while it is warm in the cache

    def __init__(self) -> None:
        self.sums: NamedTensors = {}
        self.weights: dict[str, float] = {}
        self._wide: torch.Tensor | None = None

    def add(self, tensors: NamedTensors, weight: float) -> None:
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"a weighted mean takes finite weights >= 0, not {weight}")
        for name, value in tensors.items():
            if name not in self.sums:
                self.sums[name] = torch.zeros_like(value, dtype=torch.float64)
                self.weights[name] = 0.0
            self._accumulate(self.sums[name], value, weight)
            self.weights[name] += weight

    def _accumulate(self, total: torch.Tensor, value: torch.Tensor, weight: float) -> None:
        """``total += weight * value`` in float64. Added straight, an fp32 ``value`` goes through torch's mixed-dtype
        path, which converts it into a fresh float64 tensor the size of the whole tensor (MiniLM: ~135 ms a client);
        converted a chunk at a time into one reused buffer, the same products and sums (each exact, or rounded
        once) take ~2.5x less."""
        if value.dtype == torch.float64 or total.device.type != "cpu" or not total.is_contiguous():
            total.add_(value, alpha=weight)
            return
        if self._wide is None:
            self._wide = torch.empty(self.CHUNK, dtype=torch.float64)
        flat_total, flat_value = total.view(-1), value.reshape(-1)
        for start in range(0, flat_value.numel(), self.CHUNK):
            part = flat_value[start:start + self.CHUNK]
            wide = self._wide[:part.numel()]
            wide.copy_(part)
            flat_total[start:start + part.numel()].add_(wide, alpha=weight)

    def merge(self, collective: Collective) -> None:
        """Add the other processes' sums of the same round (torch.distributed workers), so every process holds
        the sums over all items. A name some process never saw joins with a zero sum; names keep the order in
        which the processes, in rank order, first saw them."""
        seen = collective.all_gather({name: (tuple(total.shape), self.weights[name])
                                      for name, total in self.sums.items()})
        names = list(dict.fromkeys(name for part in seen for name in part))
        for name in names:
            shape = next(part[name][0] for part in seen if name in part)
            self.sums.setdefault(name, torch.zeros(shape, dtype=torch.float64))
        collective.all_sum([self.sums[name] for name in names])
        self.sums = {name: self.sums[name] for name in names}
        self.weights = {name: sum(part[name][1] for part in seen if name in part) for name in names}

    def mean(self) -> NamedTensors:
        """The fp32 mean of every name added so far (in the order names first came)."""
        for name, weight in self.weights.items():
            if weight <= 0:
                raise ValueError(f"a weighted mean needs positive total weight (tensor {name})")
        return {name: (total / self.weights[name]).to(torch.float32) for name, total in self.sums.items()}


def weighted_mean(items: list[tuple[NamedTensors, float]]) -> NamedTensors:
    """:class:`RunningMean` over ``items`` (tensors, weight) at once."""
    running = RunningMean()
    for tensors, weight in items:
        running.add(tensors, weight)
    return running.mean()


def squared_distance(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> float:
    """||a - b||^2, the differences taken in ``dtype`` and the squares summed per chunk. float64 makes every
    difference of fp32 values exact (norm bounding scales updates by it); float32, half the memory traffic, is
    enough for the screen's recorded change norms, which every report of every round pays for. A whole-tensor
    difference is a fresh tensor the size of ``a`` (twice it in float64), its pages new for every client
    (MiniLM's embedding: 47 MB); a chunk at a time through one buffer (:attr:`RunningMean.CHUNK` values), the
    same differences cost a fraction of that."""
    if a.device.type != "cpu" or a.numel() <= RunningMean.CHUNK:
        return float((a.to(dtype) - b.to(dtype)).pow(2).sum())
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    wide = torch.empty(RunningMean.CHUNK, dtype=dtype)
    total = 0.0
    for start in range(0, flat_a.numel(), RunningMean.CHUNK):
        part = wide[: min(RunningMean.CHUNK, flat_a.numel() - start)]
        chunk_a, chunk_b = flat_a[start:start + part.numel()], flat_b[start:start + part.numel()]
        if chunk_a.dtype == chunk_b.dtype == dtype:
            torch.sub(chunk_a, chunk_b, out=part)  # one pass
        else:  # converted first: torch.sub would subtract in the inputs' dtype and only then widen
            part.copy_(chunk_a).sub_(chunk_b)
        total += float(torch.dot(part, part))
    return total
