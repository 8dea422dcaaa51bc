"""One timed round of split training through fedlm's :class:`~fedlm.split.executor.SplitExecutor`, in process:
the unit the trunk-mode benchmarks (``bench_client_batch.py``, ``bench_fl_glm_modes.py``) compare."""

from __future__ import annotations

import time

import torch

from fedlm.config import SplitConfig
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.store import ClientStore
from fedlm.split.executor import SplitExecutor


def _sync() -> None:
    """Waits for queued GPU work, so that a timer reads the work and not its launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_split_round(model: torch.nn.Module, task, rows: dict[int, list[dict]], start: dict,
                     settings: LocalSettings, spec: SplitConfig) -> float:
    """Round 1 of ``spec`` from the weights ``start``, every client in ``rows`` taking its turn: wall seconds of the
    clients' turns (the engine's aggregation, the same for every trunk mode, is left out). Every client must
    report."""
    executor = SplitExecutor(model, spec, task, rows, get_codec("fp32"), ClientStore({}), settings)
    sent = get_codec("fp32").encode(executor.downlink(start))
    jobs = [ClientJob(cid, 1, sent, settings, seed=cid) for cid in rows]
    executor.begin_round(1, start)
    _sync()
    began = time.perf_counter()
    reports = executor.run(jobs)
    _sync()
    elapsed = time.perf_counter() - began
    executor.close()
    assert all(isinstance(r, ClientReport) for r in reports), reports
    return elapsed
