"""In-process execution of client rounds: one model object, reloaded per client, for fast simulation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from fedlm.federation.client_round import client_failure, fit_client
from fedlm.federation.codecs import Codec
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.params import NamedTensors
from fedlm.federation.store import ClientStore
from fedlm.tasks import Task

FitFn = Callable[..., tuple[ClientReport, NamedTensors]]  # fit_client's signature (on_step: when steps are shown)


class InProcessExecutor:
    """Runs the sampled clients one after another in this process, catching each client's failure.

    ``progress`` hears of each finished client and ``on_step`` of each local step (both by client id); a
    ``fit_fn`` is passed ``on_step`` only when steps are asked for."""

    def __init__(self, model: torch.nn.Module, task: Task, client_rows: dict[int, Sequence[dict]],
                 codec: Codec, store: ClientStore, local_names: list[str],
                 fit_fn: FitFn = fit_client, progress: Callable[[int], None] | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.task = task
        self.client_rows = client_rows
        self.codec = codec
        self.store = store
        self.local_names = local_names
        self.fit_fn = fit_fn
        self.progress = progress
        self.on_step = on_step

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
        steps = {} if self.on_step is None else {"on_step": partial(self.on_step, job.client_id)}
        try:
            report, local = self.fit_fn(self.model, self.task, self.client_rows[job.client_id], job,
                                        self.codec, self.store.get(job.client_id), self.local_names, **steps)
        except Exception as exc:  # a client's crash must not take the round down
            return client_failure(job.client_id, exc)
        self.store.put(job.client_id, local)
        return report
