"""A round's clients spread over the processes of a run (``fedlm run --workers N``, or ``torchrun``).

Every process holds the same model and drives the same round loop; :class:`ShardedExecutor` hands each its
share of the round's jobs (:func:`assign`), trains them with the in-process executor, and afterwards gives every
process the local states its clients kept, so any process can train or score any client next round. The round
engine then combines the processes' tallies and partial aggregates (``RoundEngine.collective``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping

from fedlm.federation.collective import Collective
from fedlm.federation.executor import ClientJob, ClientReport, Executor, Result
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.simulation import InProcessExecutor


def assign(jobs: list[ClientJob], costs: Mapping[int, int], world: int) -> list[int]:
    """Each job's process: the costliest clients first, each to the process with the least work so far (ties to
    the lowest rank): a pure function of the round, so every process computes the same split."""
    order = sorted(range(len(jobs)), key=lambda i: (-costs.get(jobs[i].client_id, 1), i))
    loads = [(0, rank) for rank in range(world)]
    owner = [0] * len(jobs)
    for i in order:
        load, rank = heapq.heappop(loads)
        owner[i] = rank
        heapq.heappush(loads, (load + costs.get(jobs[i].client_id, 1), rank))
    return owner


def client_cost(examples: int, settings: LocalSettings) -> int:
    """A client's work in a round, in batches: its local steps, plus one for what every client costs besides
    (loading the model, a fresh optimizer, the update's checks and encoding), which rules when clients are tiny."""
    steps = settings.local_steps or settings.local_epochs * math.ceil(max(examples, 1) / settings.batch_size)
    return steps + 1


class ShardedExecutor(Executor):
    """This process's share of every round, trained in place by ``inner``; results come in job order."""

    def __init__(self, inner: InProcessExecutor, collective: Collective) -> None:
        self.inner = inner
        self.collective = collective
        self.examples = {client_id: len(rows) for client_id, rows in inner.client_rows.items()}
        self.keeps_states = bool(inner.store.initial)  # clients keep local parameters between rounds

    def run(self, jobs: list[ClientJob]) -> Iterator[Result]:
        costs = {job.client_id: client_cost(self.examples.get(job.client_id, 0), job.settings) for job in jobs}
        owner = assign(jobs, costs, self.collective.world)
        mine = [job for job, rank in zip(jobs, owner, strict=True) if rank == self.collective.rank]
        kept = {}
        for result in self.inner.run(mine):
            if self.keeps_states and isinstance(result, ClientReport):
                kept[result.update.client_id] = self.inner.store.get(result.update.client_id)
            yield result
        for job, rank in zip(jobs, owner, strict=True):  # trained alongside, on balanced shares: done by now
            if rank != self.collective.rank:
                self.inner.observer.client_done(job.client_id)
        if self.keeps_states:
            self._share_states(kept)

    def _share_states(self, kept: dict) -> None:
        """Every process's clients' new local states into every process's store."""
        for rank, states in enumerate(self.collective.all_gather(kept)):
            if rank != self.collective.rank:
                for client_id, state in states.items():
                    self.inner.store.put(client_id, state)

    def close(self) -> None:
        self.inner.close()
