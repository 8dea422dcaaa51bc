"""Scoring during a run: the global model on the shared test split, each client's model on its own split."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedlm.federation.collective import LOCAL, Collective
from fedlm.federation.params import NamedTensors, load_into
from fedlm.federation.store import ClientStore
from fedlm.run.label_prior import label_prior_scores, num_labels_of
from fedlm.run.prepare import Prepared
from fedlm.tasks import ClassificationTask


class Evaluator:
    """Global model on the global test split (and the validation split, as ``val_*``, where the run has one);
    each evaluated client's model on its local test split.

    When clients keep local parameters (personalized runs), there is no single global model: each client's
    own model (global part + its local part) is scored on the global test split too, as mean and std. Beside
    the local scores of a classification run goes each client's label prior (its majority training label).
    ``on_batch`` follows each scoring's batches (``Task.evaluate``), for a progress bar. With ``collective``'s
    processes (``fedlm run --workers``) each scoring is spread over them, batch by batch; every process gets the
    scores."""

    def __init__(self, prep: Prepared, store: ClientStore, personalized: bool,
                 on_batch: Callable[[int, int], None] | None = None, collective: Collective = LOCAL) -> None:
        self.prep = prep
        self.share = BatchShare(collective) if collective.world > 1 else None
        self.on_batch = on_batch
        self.store = store
        self.personalized = personalized
        self.batch_size = prep.config.eval.batch_size
        self.local = prep.config.eval.local and prep.config.protocol.traits.evaluates_clients
        self.priors: dict[int, dict[str, float] | None] = {}  # label-prior scores per client, found once

    def _prior(self, client_id: int) -> dict[str, float] | None:
        """The client's label-prior score on its local test set (see ``label_prior``), computed once."""
        if not isinstance(self.prep.task, ClassificationTask):  # no majority label to predict
            return None
        if client_id not in self.priors:
            prep = self.prep
            labels = num_labels_of(prep.loaded.label_names, prep.client_train.get(client_id, []),
                                   prep.client_test[client_id])
            self.priors[client_id] = label_prior_scores(prep.task, prep.client_train.get(client_id, []),
                                                        prep.client_test[client_id], labels)
        return self.priors[client_id]

    def _score(self, rows: list[dict]) -> dict[str, float]:
        generator = torch.Generator().manual_seed(self.prep.config.seed)
        return self.prep.task.evaluate(self.prep.model, rows, self.batch_size, generator, on_batch=self.on_batch,
                                       share=self.share)

    def _client_model(self, global_params: NamedTensors, client_id: int) -> None:
        load_into(self.prep.model, global_params)
        load_into(self.prep.model, self.store.get(client_id))

    def __call__(self, round_idx: int, global_params: NamedTensors, clients: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        held_out = [("test", self.prep.test_rows)] + ([("val", self.prep.validation_rows)]
                                                      if self.prep.validation_rows else [])
        if self.personalized:
            per_client: dict[str, dict[int, dict[str, float]]] = {prefix: {} for prefix, _ in held_out}
            for cid in clients:
                self._client_model(global_params, cid)  # once per client, whatever it is scored on
                for prefix, rows in held_out:
                    per_client[prefix][cid] = self._score(rows)
            for prefix, scores in per_client.items():
                out.update(spread(prefix, scores))
        else:
            load_into(self.prep.model, global_params)
            for prefix, rows in held_out:
                out.update({f"{prefix}_{k}": v for k, v in self._score(rows).items()})
            if self.prep.triggered_test:  # a backdoor's success: triggered test examples given the target label
                out["attack_success_rate"] = self._score(self.prep.triggered_test)["accuracy"]
        if self.local:
            per_client = {}
            for cid in clients:
                if self.prep.client_test.get(cid):
                    self._client_model(global_params, cid)
                    per_client[cid] = self._score(self.prep.client_test[cid])
            out.update(spread("local", per_client))
            priors = {cid: prior for cid in per_client if (prior := self._prior(cid)) is not None}
            out.update(spread("local_prior", priors))  # beside every local score: what the majority label gets
        return out


@dataclass(frozen=True)
class BatchShare:
    """An evaluation's batches dealt round-robin over the processes of a run (``Task.evaluate``'s share)."""

    collective: Collective

    def owns(self, index: int) -> bool:
        return index % self.collective.world == self.collective.rank

    def merge(self, parts: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        merged: dict[int, dict[str, Any]] = {}
        for theirs in self.collective.all_gather(parts):
            merged.update(theirs)
        return merged


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
