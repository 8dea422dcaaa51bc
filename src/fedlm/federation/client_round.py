"""A client's side of one round, shared by the in-process simulator and the Flower ClientApp.

decode what the server sent -> put the client's own local parameters back -> freeze this round's frozen
parameters -> train -> refuse a non-finite update -> encode the trained global part for upload; the local
part stays with the client and frozen parameters are not sent back.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from fedlm.federation.codecs import Codec
from fedlm.federation.engine import ClientJob, ClientReport
from fedlm.federation.local_training import train_locally
from fedlm.federation.params import NamedTensors, all_finite, load_into, snapshot
from fedlm.federation.strategies.base import ClientUpdate


class NonFiniteUpdate(RuntimeError):
    """A client's training produced NaN or Inf: its update must not reach the aggregate."""


@contextmanager
def frozen(model: torch.nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Turn off gradients for ``names`` while training (no weight-gradient compute, no optimizer state)."""
    params = dict(model.named_parameters())
    touched = [params[n] for n in names if params[n].requires_grad]
    for p in touched:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in touched:
            p.requires_grad_(True)


def finite_update(model: torch.nn.Module, names: Sequence[str], metrics: dict[str, float]) -> NamedTensors:
    """Snapshot the parameters a client is about to send, refusing NaN/Inf in its loss or in them."""
    if not math.isfinite(metrics["train_loss"]):
        raise NonFiniteUpdate(f"train loss is {metrics['train_loss']}")
    shared = snapshot(model, list(names))
    bad = all_finite(shared)
    if bad is not None:
        raise NonFiniteUpdate(f"parameter {bad} holds NaN or Inf")
    return shared


def fit_client(model: torch.nn.Module, task: Any, rows: Sequence[dict], job: ClientJob, codec: Codec,
               local_state: NamedTensors | None, local_names: list[str]) -> tuple[ClientReport, NamedTensors]:
    """Run one client's round; returns what it uploads and its new local state."""
    received = codec.decode(job.params)
    load_into(model, received)
    if local_state:
        load_into(model, local_state)
    deadline = job.deadline()
    skip = set(job.frozen)
    trained = [n for n in received if n not in skip]
    anchor = {n: received[n] for n in trained} if job.settings.mu > 0 else None
    with frozen(model, job.frozen):
        metrics = train_locally(model, task, rows, job.settings, seed=job.seed, anchor=anchor, deadline=deadline)
    shared = finite_update(model, trained, metrics)
    encoded = codec.encode(shared)
    update = ClientUpdate(job.client_id, len(rows), codec.decode(encoded), metrics)
    return ClientReport(update, encoded.total_bytes, encoded.meta_bytes), snapshot(model, local_names)
