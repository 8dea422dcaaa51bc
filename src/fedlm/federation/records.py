"""What a run records of each round: one line of ``metrics.jsonl`` per record, written and read back here.

A line holds the round's training (loss, clients, examples), its bytes each way, its times, what a strategy
keeps in its ledger (differential privacy's epsilon) and the evaluation's scores. The keys and their order are
those every earlier run wrote, so old run directories read, resume and compare as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedlm.federation.executor import ClientFailure

TRAINING_KEYS = ("round", "train_loss", "clients", "failed", "train_examples", "bytes_down", "bytes_up",
                 "bytes_down_meta", "bytes_up_meta")
BOUNDARY_KEYS = ("bytes_up_boundary", "bytes_down_boundary", "bytes_by_client")


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
        if self.train_s is not None:
            out["train_s"] = self.train_s
        out.update(self.ledger)
        out.update(self.scores)
        out["wall_s"] = self.wall_s
        return out

    @classmethod
    def from_dict(cls, line: dict[str, Any]) -> RoundRecord:
        """A ``metrics.jsonl`` line read back (ledger entries are the ``dp_`` keys; any other key is a score)."""
        known = {*TRAINING_KEYS, *BOUNDARY_KEYS, "train_s", "wall_s"}
        boundary = None
        if "bytes_up_boundary" in line:
            boundary = Boundary(line["bytes_up_boundary"], line["bytes_down_boundary"], line["bytes_by_client"])
        return cls(round=line["round"], train_loss=line.get("train_loss"), clients=list(line.get("clients", [])),
                   failed=[ClientFailure(f["client"], f["reason"]) for f in line.get("failed", [])],
                   train_examples=line.get("train_examples", 0), bytes_down=line.get("bytes_down", 0),
                   bytes_up=line.get("bytes_up", 0), bytes_down_meta=line.get("bytes_down_meta", 0),
                   bytes_up_meta=line.get("bytes_up_meta", 0), boundary=boundary, train_s=line.get("train_s"),
                   ledger={k: v for k, v in line.items() if k.startswith("dp_")},
                   scores={k: v for k, v in line.items() if k not in known and not k.startswith("dp_")},
                   wall_s=line.get("wall_s", 0.0))


@dataclass
class FailedRound:
    """A round that could not complete: too few clients reported, even after the allowed retries."""

    round: int
    reported: int
    needed: int
    attempts: int
    failed: list[ClientFailure]

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "round_failed": True, "reported": self.reported, "needed": self.needed,
                "attempts": self.attempts, "failed": failure_entries(self.failed)}
