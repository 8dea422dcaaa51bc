"""A client's side of one round, shared by the in-process simulator and the Flower ClientApp.

decode what the server sent -> put the client's own local parameters back -> train -> refuse a non-finite
update -> encode the global part for upload; the local part stays with the client.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from fedlm.federation.client import train_locally
from fedlm.federation.codecs import CastCodec
from fedlm.federation.engine import ClientJob, ClientReport
from fedlm.federation.params import NamedTensors, all_finite, load_into, snapshot
from fedlm.federation.strategies import ClientUpdate


class NonFiniteUpdate(RuntimeError):
    """A client's training produced NaN or Inf: its update must not reach the aggregate."""


def fit_client(model: torch.nn.Module, task: Any, rows: Sequence[dict], job: ClientJob, codec: CastCodec,
               local_state: NamedTensors | None, local_names: list[str]) -> tuple[ClientReport, NamedTensors]:
    """Run one client's round; returns what it uploads and its new local state."""
    received = codec.decode(job.params)
    load_into(model, received)
    if local_state:
        load_into(model, local_state)
    deadline = time.monotonic() + job.timeout_s if job.timeout_s else None
    anchor = received if job.settings.mu > 0 else None
    metrics = train_locally(model, task, rows, job.settings, seed=job.seed, anchor=anchor, deadline=deadline)
    if not math.isfinite(metrics["train_loss"]):
        raise NonFiniteUpdate(f"train loss is {metrics['train_loss']}")
    shared = snapshot(model, list(received))
    bad = all_finite(shared)
    if bad is not None:
        raise NonFiniteUpdate(f"parameter {bad} holds NaN or Inf")
    encoded = codec.encode(shared)
    update = ClientUpdate(job.client_id, len(rows), codec.decode(encoded), metrics)
    return ClientReport(update, encoded.total_bytes), snapshot(model, local_names)
