"""Fair turns at the trunk: one message computes at a time, and waiting clients are served round-robin.

A plain lock lets whoever grabs it next go first, so a client with many sessions (or many messages queued)
can keep the others waiting for as long as it likes. :class:`RoundRobin` keeps one queue per client and
hands the trunk to the waiting clients in turn: a client's message waits for at most one message of each
other waiting client, each bounded in size by :class:`~fedlm.split.trunk.TrunkLimits`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["RoundRobin"]


class RoundRobin:
    """Mutual exclusion granted client by client in turn (FIFO within a client)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: object | None = None  # the ticket now computing
        self._queues: dict[str, deque[object]] = {}  # client -> its waiting tickets, oldest first
        self._ring: deque[str] = deque()  # clients with waiting tickets, in the order they are served

    @contextmanager
    def turn(self, client_id: str) -> Iterator[None]:
        """Hold the trunk for one message of ``client_id``, once the clients ahead in the ring had theirs."""
        ticket = object()
        with self._cond:
            if self._holder is None and not self._ring:
                self._holder = ticket
            else:
                queue = self._queues.setdefault(client_id, deque())
                if not queue:
                    self._ring.append(client_id)
                queue.append(ticket)
                self._cond.wait_for(lambda: self._holder is ticket)
        try:
            yield
        finally:
            self._pass_on()

    def waiting(self) -> dict[str, int]:
        """How many messages each client has waiting (for logs and tests)."""
        with self._cond:
            return {cid: len(queue) for cid, queue in self._queues.items()}

    def _pass_on(self) -> None:
        with self._cond:
            self._holder = None
            if self._ring:
                client_id = self._ring.popleft()
                queue = self._queues[client_id]
                self._holder = queue.popleft()
                if queue:
                    self._ring.append(client_id)  # its next message goes behind everyone now waiting
                else:
                    del self._queues[client_id]
                self._cond.notify_all()
