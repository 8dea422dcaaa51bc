"""In-process execution of client rounds: one model object, reloaded per client, for fast simulation.

With ``client_timeout_s`` each client trains a working copy of the model in a worker thread that the round
stops waiting for at the deadline (:func:`~fedlm.federation.client_round.call_with_deadline`): the
abandoned worker keeps its copy (which stops it at its next module call), the next client gets a fresh one,
and its late result is never read, so neither the run's model nor the client store sees anything of it.
Caveat: until that next module call, a worker back from a stuck step may still draw from torch's global
random generator (dropout) while the next client trains, shifting that client's draws; results stay
correct, but such a round is not bitwise reproducible.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from fedlm.federation.client_round import (
    ClientAbandoned,
    call_with_deadline,
    client_failure,
    fit_client,
    stop_at_next_module,
)
from fedlm.federation.codecs import Codec
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport, Executor
from fedlm.federation.observer import SILENT, RoundObserver
from fedlm.federation.params import NamedTensors
from fedlm.federation.store import ClientStore
from fedlm.tasks import Task

FitFn = Callable[..., tuple[ClientReport, NamedTensors]]  # fit_client's signature (on_step: when steps are shown)


class InProcessExecutor(Executor):
    """Runs the sampled clients one after another in this process, catching each client's failure.

    ``observer`` hears of each local step and each finished client; a ``fit_fn`` is passed ``on_step`` only
    when someone watches (an observer other than the silent one)."""

    def __init__(self, model: torch.nn.Module, task: Task, client_rows: dict[int, Sequence[dict]],
                 codec: Codec, store: ClientStore, local_names: list[str],
                 fit_fn: FitFn = fit_client, observer: RoundObserver = SILENT) -> None:
        self.model = model
        self.task = task
        self.client_rows = client_rows
        self.codec = codec
        self.store = store
        self.local_names = local_names
        self.fit_fn = fit_fn
        self.observer = observer
        self._working: torch.nn.Module | None = None  # what a client with a deadline trains (see the module doc)

    def run(self, jobs: list[ClientJob]) -> Iterator[ClientReport | ClientFailure]:
        for job in jobs:
            result = self._run_one(job)
            self.observer.client_done(job.client_id)
            yield result

    def _run_one(self, job: ClientJob) -> ClientReport | ClientFailure:
        abandoned = threading.Event()
        steps = {} if self.observer is SILENT else {"on_step": partial(self._step, job.client_id, abandoned)}
        model = self._working_model() if job.timeout_s else self.model
        work = partial(self.fit_fn, model, self.task, self.client_rows[job.client_id], job, self.codec,
                       self.store.get(job.client_id), self.local_names, **steps)
        try:
            report, local = call_with_deadline(work, job.timeout_s, name=f"fedlm-client-{job.client_id}")
        except ClientAbandoned as exc:
            abandoned.set()  # its later steps are not shown
            stop_at_next_module(model)  # the abandoned worker keeps this copy: it stops at its next module
            self._working = None  # ... and nobody uses the copy again
            return client_failure(job.client_id, exc)
        except Exception as exc:  # a client's crash must not take the round down
            return client_failure(job.client_id, exc)
        self.store.put(job.client_id, local)
        return report

    def _working_model(self) -> torch.nn.Module:
        """The copy clients with a deadline train, made from the run's model when none is at hand. Each
        client loads what it was sent and its local state into it, so a fresh copy trains as the last one."""
        if self._working is None:
            self._working = copy.deepcopy(self.model)
        return self._working

    def _step(self, client_id: int, abandoned: threading.Event) -> None:
        if not abandoned.is_set():
            self.observer.client_step(client_id)
