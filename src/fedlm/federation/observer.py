"""What a round tells whoever watches it (``fedlm.run.progress`` draws bars and prints a line per round)."""

from __future__ import annotations

from fedlm.federation.executor import ClientJob
from fedlm.federation.records import RoundRecord


class RoundObserver:
    """Hears of a round's progress from the engine and from the executor running its clients. Every method is a
    no-op here, so an observer overrides only what it shows: the engine reports clients starting, evaluation and
    each recorded round; executors report each client's local steps and each finished (or failed) client."""

    def clients_started(self, round_idx: int, jobs: list[ClientJob]) -> None:
        """The round's clients (again, on a retried attempt) are about to train."""

    def client_step(self, client_id: int) -> None:
        """One local step of ``client_id`` is done."""

    def client_done(self, client_id: int) -> None:
        """``client_id`` finished or failed."""

    def evaluation_started(self, round_idx: int) -> None:
        """The round's model is being scored."""

    def evaluation_batch(self, done: int, batches: int) -> None:
        """Batch ``done`` of ``batches`` of one scored data set is done."""

    def evaluation_done(self) -> None:
        """Scoring ended (or failed)."""

    def round_done(self, record: RoundRecord) -> None:
        """The round is recorded."""


SILENT = RoundObserver()  # for executors and engines nobody watches
