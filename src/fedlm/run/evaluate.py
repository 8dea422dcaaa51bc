"""Scoring during a run: the global model on the shared test split, each client's model on its own split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedlm.federation.params import NamedTensors, load_into
from fedlm.federation.store import ClientStore
from fedlm.run.prepare import Prepared


class Evaluator:
    """Global model on the global test split; each evaluated client's model on its local test split.

    When clients keep local parameters (personalized runs), there is no single global model: each client's
    own model (global part + its local part) is scored on the global test split too, as mean and std.
    ``on_batch`` follows each scoring's batches (``Task.evaluate``), for a progress bar."""

    def __init__(self, prep: Prepared, store: ClientStore, personalized: bool,
                 on_batch: Callable[[int, int], None] | None = None) -> None:
        self.prep = prep
        self.on_batch = on_batch
        self.store = store
        self.personalized = personalized
        self.batch_size = prep.config.eval.batch_size
        self.local = prep.config.eval.local and prep.config.protocol.kind != "centralized"

    def _score(self, rows: list[dict]) -> dict[str, float]:
        generator = torch.Generator().manual_seed(self.prep.config.seed)
        return self.prep.task.evaluate(self.prep.model, rows, self.batch_size, generator, on_batch=self.on_batch)

    def _client_model(self, global_params: NamedTensors, client_id: int) -> None:
        load_into(self.prep.model, global_params)
        load_into(self.prep.model, self.store.get(client_id))

    def __call__(self, round_idx: int, global_params: NamedTensors, clients: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.personalized:
            per_client = {}
            for cid in clients:
                self._client_model(global_params, cid)
                per_client[cid] = self._score(self.prep.test_rows)
            out.update(spread("test", per_client))
        else:
            load_into(self.prep.model, global_params)
            out.update({f"test_{k}": v for k, v in self._score(self.prep.test_rows).items()})
        if self.local:
            per_client = {}
            for cid in clients:
                if self.prep.client_test.get(cid):
                    self._client_model(global_params, cid)
                    per_client[cid] = self._score(self.prep.client_test[cid])
            out.update(spread("local", per_client))
        return out


def spread(prefix: str, per_client: dict[int, dict[str, float]]) -> dict[str, Any]:
    """Mean and std over clients of every metric, plus the per-client values."""
    if not per_client:
        return {}
    out: dict[str, Any] = {}
    for metric in next(iter(per_client.values())):
        values = np.array([m[metric] for m in per_client.values()], dtype=float)
        out[f"{prefix}_{metric}_mean"] = float(values.mean())
        out[f"{prefix}_{metric}_std"] = float(values.std())
    out[f"{prefix}_by_client"] = {str(c): m for c, m in per_client.items()}
    return out
