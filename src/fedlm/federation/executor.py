"""Where a round's clients run: the jobs they are given, what they report, and the executor that runs them.

The round engine hands an :class:`Executor` the round's jobs and folds each result into the aggregate as it
comes back. The base executor holds no server-side state: split learning's executor overrides the round
hooks (what clients are sent, the trunk taking the round's start, what the server trained itself).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from fedlm.federation.codecs import Encoded
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import NamedTensors
from fedlm.federation.strategies.base import ClientUpdate


@dataclass(frozen=True)
class ClientJob:
    """One client's instructions for one round."""

    client_id: int
    round_idx: int
    params: Encoded
    settings: LocalSettings
    seed: int
    timeout_s: float | None = None
    frozen: tuple[str, ...] = ()  # global parameters this client neither trains nor uploads this round

    def deadline(self) -> float | None:
        """The ``time.monotonic()`` value local training must finish by, counted from now (None: no limit)."""
        return time.monotonic() + self.timeout_s if self.timeout_s else None


@dataclass(frozen=True)
class ClientFailure:
    client_id: int
    reason: str
    lasting: bool = False  # the code or the model failed, not the client: retrying other clients cannot help


@dataclass
class ClientReport:
    """An update as the server received it: decoded params plus what it cost to send."""

    update: ClientUpdate
    upload_bytes: int  # parameters sent, scale metadata included
    upload_meta_bytes: int = 0
    boundary_up: int = 0  # split learning: activations and gradients the client sent to the trunk
    boundary_down: int = 0  # ... and received from it
    download_extra: int = 0  # received besides the round's downlink (split: an optimizer state handed on)


Result = ClientReport | ClientFailure


class Executor:
    """Runs a round's clients: in this process (simulation), on Flower nodes, or against a split trunk.

    ``run`` yields one result per job, in job order, as each becomes known, so the engine can fold it into the
    aggregate without holding the round's updates. A report's tensors may be the executor's own model's (the
    simulator does not copy an upload), valid until the next result is asked for: keep one longer, copy it.
    The round hooks are no-ops here: the clients are sent the global parameters as they are, and the server
    trains nothing itself."""

    def downlink(self, global_params: NamedTensors) -> NamedTensors:
        """What every client of the round is sent."""
        return global_params

    def begin_round(self, round_idx: int, global_params: NamedTensors) -> None:
        """Server-side state takes the round's starting point (again on a retried attempt)."""

    def run(self, jobs: list[ClientJob]) -> Iterable[Result]:
        raise NotImplementedError

    def server_params(self) -> NamedTensors:
        """Global parameters the server trained itself this round; they replace the aggregate's values."""
        return {}

    def close(self) -> None:
        """Release what the executor holds (servers, threads)."""
