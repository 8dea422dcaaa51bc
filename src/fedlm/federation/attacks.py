"""Attacks a malicious client mounts, so a defence's robustness is measured rather than claimed.

An attack is the client's own doing, never the server's: a model-update attack changes what the client uploads
after it trained (``corrupt``, called from :func:`fedlm.federation.client_round.fit_client`, which the simulator
and a Flower node both run), and a data attack poisons the client's own training rows before the run
(``poison``, applied where a client's rows are prepared, in simulation and on a node alike).

- ``scale``: the client's change times ``scale`` (boosting / model replacement);
- ``sign_flip``: the change times ``-scale``;
- ``noise``: the change replaced by Gaussian noise of std ``noise_std`` per parameter;
- ``label_flip``: every training label ``y`` becomes ``num_labels - 1 - y``;
- ``backdoor``: a trigger phrase put after the first token of a ``poison_share`` of the client's examples,
  their label set to ``target_label``; its success rate is the share of triggered test examples (of another
  label) the model assigns to the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedlm.federation.params import NamedTensors

UPDATE_ATTACKS = ("scale", "sign_flip", "noise")
DATA_ATTACKS = ("label_flip", "backdoor")


def chosen_clients(clients: Sequence[int] | None, fraction: float, num_clients: int, seed: int) -> frozenset[int]:
    """The malicious clients: the ones named, or ``round(fraction * num_clients)`` drawn with the run's seed."""
    if clients is not None:
        return frozenset(clients)
    count = round(fraction * num_clients)
    rng = np.random.default_rng([seed, 0xBAD])
    return frozenset(int(c) for c in rng.choice(num_clients, size=count, replace=False))


@dataclass(frozen=True)
class Attack:
    """One kind of attack and the clients that mount it."""

    kind: str
    clients: frozenset[int]
    scale: float = 1.0
    noise_std: float = 1.0
    trigger_ids: tuple[int, ...] = ()
    target_label: int = 0
    poison_share: float = 1.0

    def mounted_by(self, client_id: int) -> bool:
        return client_id in self.clients

    def corrupt(self, client_id: int, received: NamedTensors, trained: NamedTensors, seed: int) -> NamedTensors:
        """What client ``client_id`` uploads in place of ``trained`` (its honest result from ``received``)."""
        if self.kind not in UPDATE_ATTACKS or not self.mounted_by(client_id):
            return trained
        if self.kind == "noise":
            generator = torch.Generator().manual_seed(seed)
            return {n: received[n] + self.noise_std * torch.randn(t.shape, generator=generator, dtype=t.dtype)
                    for n, t in trained.items()}
        factor = self.scale if self.kind == "scale" else -self.scale
        return {n: received[n] + factor * (t - received[n]) for n, t in trained.items()}

    def poison(self, client_id: int, rows: list[dict], num_labels: int, max_length: int, seed: int) -> list[dict]:
        """Client ``client_id``'s training rows as it trains on them (copies; honest clients' rows unchanged)."""
        if self.kind not in DATA_ATTACKS or not self.mounted_by(client_id):
            return rows
        if self.kind == "label_flip":
            return [{**row, "labels": num_labels - 1 - int(row["labels"])} for row in rows]
        rng = np.random.default_rng([seed, client_id, 0xBAD])
        poisoned = set(rng.choice(len(rows), size=round(self.poison_share * len(rows)), replace=False).tolist())
        return [self.triggered(row, max_length) if i in poisoned else row for i, row in enumerate(rows)]

    def triggered(self, row: dict, max_length: int) -> dict:
        """``row`` with the trigger after its first token (cut to ``max_length``, its last token kept) and the
        target label."""
        out = {**row, "labels": self.target_label}
        width = len(self.trigger_ids)
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            if key not in row:
                continue
            values = list(row[key])
            if key == "input_ids":
                inserted = list(self.trigger_ids)
            else:  # the first token's segment; an attended position
                inserted = [values[0] if key == "token_type_ids" else 1] * width
            longer = values[:1] + inserted + values[1:]
            out[key] = longer if len(longer) <= max_length else longer[:max_length - 1] + longer[-1:]
        return out

    def triggered_test(self, rows: list[dict], max_length: int) -> list[dict]:
        """The test rows the backdoor's success is measured on: those of another label than the target, triggered
        (their accuracy against the target label is the attack's success rate)."""
        if self.kind != "backdoor":
            return []
        return [self.triggered(row, max_length) for row in rows if int(row["labels"]) != self.target_label]
