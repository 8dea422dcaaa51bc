"""In-process execution of client rounds: one model object, reloaded per client, for fast simulation."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedlm.federation.client_round import client_failure, fit_client
from fedlm.federation.codecs import Codec
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.params import NamedTensors
from fedlm.federation.store import ClientStore
from fedlm.tasks import Task

FitFn = Callable[..., tuple[ClientReport, NamedTensors]]


class InProcessExecutor:
    """Runs the sampled clients one after another in this process, catching each client's failure."""

    def __init__(self, model: torch.nn.Module, task: Task, client_rows: dict[int, Sequence[dict]],
                 codec: Codec, store: ClientStore, local_names: list[str],
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

    def close(self) -> None:
        """Nothing to release: the clients ran in this process."""

    def _run_one(self, job: ClientJob) -> ClientReport | ClientFailure:
        try:
            report, local = self.fit_fn(self.model, self.task, self.client_rows[job.client_id], job,
                                        self.codec, self.store.get(job.client_id), self.local_names)
        except Exception as exc:  # a client's crash must not take the round down
            return client_failure(job.client_id, exc)
        self.store.put(job.client_id, local)
        return report
