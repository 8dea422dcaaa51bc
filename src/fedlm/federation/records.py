"""What a run records of each round: one line of ``metrics.jsonl`` per record.

A line holds the round's training (loss, clients, examples), its bytes each way, its times, what a strategy
keeps in its ledger (differential privacy's epsilon) and the evaluation's scores. The keys and their order are
those every earlier run wrote, so old run directories read, resume and compare as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedlm.federation.executor import ClientFailure


def failure_entries(failures: list[ClientFailure]) -> list[dict[str, Any]]:
    """Left-out clients as a record lists them."""
    return [{"client": f.client_id, "reason": f.reason} for f in failures]


@dataclass
class Boundary:
    """Split learning's activation and gradient traffic in a round, and each reporting client's own totals."""

    up: int
    down: int
    by_client: dict[str, dict[str, int]]


@dataclass
class RoundRecord:
    """One round as trained and scored. Round 0 is the starting point: scores only, no ``train_s``."""

    round: int
    train_loss: float | None = None
    clients: list[int] = field(default_factory=list)
    failed: list[ClientFailure] = field(default_factory=list)
    train_examples: int = 0
    bytes_down: int = 0  # everything clients received: parameters, boundary messages, handed-on state
    bytes_up: int = 0
    bytes_down_meta: int = 0  # the codec's scale metadata within the parameters
    bytes_up_meta: int = 0
    boundary: Boundary | None = None
    update_norms: dict[str, float] = field(default_factory=dict)  # each report's change ||w_k - w||, by client
    defence: dict[str, Any] = field(default_factory=dict)  # whom a robust rule dropped or down-weighted
    train_s: float | None = None  # the clients' share of the round's wall time
    ledger: dict[str, Any] = field(default_factory=dict)  # the strategy's accounting (dp_epsilon, ...)
    scores: dict[str, Any] = field(default_factory=dict)  # the evaluation's (test_accuracy, local_..., ...)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line."""
        out: dict[str, Any] = {"round": self.round, "train_loss": self.train_loss, "clients": list(self.clients),
                               "failed": failure_entries(self.failed), "train_examples": self.train_examples,
                               "bytes_down": self.bytes_down, "bytes_up": self.bytes_up,
                               "bytes_down_meta": self.bytes_down_meta, "bytes_up_meta": self.bytes_up_meta}
        if self.boundary is not None:
            out.update({"bytes_up_boundary": self.boundary.up, "bytes_down_boundary": self.boundary.down,
                        "bytes_by_client": self.boundary.by_client})
        if self.update_norms:
            out["update_norms"] = dict(self.update_norms)
        if self.defence:
            out["defence"] = dict(self.defence)
        if self.train_s is not None:
            out["train_s"] = self.train_s
        out.update(self.ledger)
        out.update(self.scores)
        out["wall_s"] = self.wall_s
        return out


@dataclass(frozen=True)
class Suspect:
    """The client whose report most likely poisoned the model a failed round started from: every client diverged
    from it, and this client's report had grown most past the global model's scale in the round that made it."""

    round: int
    client: int
    tensor: str
    growth: float

    def describe(self) -> str:
        return (f"every client diverged from the model round {self.round} committed, whose largest update was "
                f"client {self.client}'s ({self.tensor} at {self.growth:.3g}x the global model's scale): that "
                "client's update poisoned it, and the checkpoint holds it; start the run afresh (fedlm run ... "
                "--overwrite) with protocol.max_update_growth below that factor, or without that client")

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "client": self.client, "tensor": self.tensor, "growth": self.growth}


@dataclass
class FailedRound:
    """A round that could not complete: too few clients reported, even after the allowed retries."""

    round: int
    reported: int
    needed: int
    attempts: int
    failed: list[ClientFailure]
    suspect: Suspect | None = None  # whose earlier update the clients' divergence points to

    def to_dict(self) -> dict[str, Any]:
        out = {"round": self.round, "round_failed": True, "reported": self.reported, "needed": self.needed,
               "attempts": self.attempts, "failed": failure_entries(self.failed)}
        if self.suspect is not None:
            out["suspect"] = self.suspect.to_dict()
        return out
