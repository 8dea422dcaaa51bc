"""Named tensors: the currency of aggregation. Everything the server sees is a dict name -> tensor."""

from __future__ import annotations

import math

import torch

NamedTensors = dict[str, torch.Tensor]


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of trainable parameters; tied weights appear once (named_parameters deduplicates)."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def snapshot(model: torch.nn.Module, names: list[str] | None = None) -> NamedTensors:
    """Detached fp32 copies of the named parameters, on CPU (None -> every trainable parameter)."""
    params = dict(model.named_parameters())
    wanted = names if names is not None else trainable_names(model)
    return {n: params[n].detach().to("cpu", torch.float32).clone() for n in wanted}


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


def weighted_mean(items: list[tuple[NamedTensors, float]]) -> NamedTensors:
    """Per name, sum_i w_i x_i / sum_i w_i over the items holding that name, in fp32, accumulated in place
    (no per-client temporaries). Items may hold different names (e.g. clients that froze different blocks)."""
    names = list(dict.fromkeys(name for tensors, _ in items for name in tensors))
    out: NamedTensors = {}
    for name in names:
        holders = [(tensors[name], weight) for tensors, weight in items if name in tensors]
        total = float(sum(w for _, w in holders))
        if not math.isfinite(total) or total <= 0:
            raise ValueError(f"weighted_mean needs positive total weight (tensor {name})")
        acc = torch.zeros_like(holders[0][0], dtype=torch.float32)
        for value, weight in holders:
            acc.add_(value, alpha=weight / total)
        out[name] = acc
    return out
