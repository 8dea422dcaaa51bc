"""In-process execution of client rounds: one model object, reloaded per client, for fast simulation."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from fedlm.federation.client import ClientTimeout
from fedlm.federation.codecs import CastCodec
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.params import NamedTensors
from fedlm.federation.worker import NonFiniteUpdate, fit_client

log = logging.getLogger("fedlm")

FitFn = Callable[..., tuple[ClientReport, NamedTensors]]


class ClientStore:
    """Each client's local (never-sent) parameters, committed to disk only at checkpoints.

    Writes during a round stay pending until ``save`` so that a run resumed from round k sees exactly the
    local states of round k, even if it was interrupted halfway through round k+1.
    """

    def __init__(self, initial: NamedTensors) -> None:
        self.initial = initial
        self.states: dict[int, NamedTensors] = {}

    def get(self, client_id: int) -> NamedTensors:
        return self.states.get(client_id, self.initial)

    def put(self, client_id: int, state: NamedTensors) -> None:
        if state:
            self.states[client_id] = state

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(self.states, tmp)
        tmp.replace(path)

    def load(self, path: Path) -> None:
        if path.is_file():
            self.states = torch.load(path, weights_only=True)


class InProcessExecutor:
    """Runs the sampled clients one after another in this process, catching each client's failure."""

    def __init__(self, model: torch.nn.Module, task: Any, client_rows: dict[int, Sequence[dict]],
                 codec: CastCodec, store: ClientStore, local_names: list[str],
                 fit_fn: FitFn = fit_client, progress: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.task = task
        self.client_rows = client_rows
        self.codec = codec
        self.store = store
        self.local_names = local_names
        self.fit_fn = fit_fn
        self.progress = progress

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        results: list[ClientReport | ClientFailure] = []
        for job in jobs:
            results.append(self._run_one(job))
            if self.progress is not None:
                self.progress(job.client_id)
        return results

    def _run_one(self, job: ClientJob) -> ClientReport | ClientFailure:
        try:
            report, local = self.fit_fn(self.model, self.task, self.client_rows[job.client_id], job,
                                        self.codec, self.store.get(job.client_id), self.local_names)
        except ClientTimeout as exc:
            return ClientFailure(job.client_id, f"timeout: {exc}")
        except NonFiniteUpdate as exc:
            return ClientFailure(job.client_id, f"non-finite update: {exc}")
        except Exception as exc:  # a client's crash must not take the round down
            log.debug("client %d crashed", job.client_id, exc_info=True)
            return ClientFailure(job.client_id, f"exception: {type(exc).__name__}: {exc}")
        self.store.put(job.client_id, local)
        return report
