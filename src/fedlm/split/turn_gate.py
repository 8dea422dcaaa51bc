"""The trunk's turn gate: a whole split round sent to the clients at once, trained in job order.

Through Flower every client turn costs a message's latency (the SuperNode's poll, a ClientApp process), so
sending a round's turns one after another pays it once per turn. With the gate, the server sends every
turn's job at once; each client opens its trunk session when it is ready, and the gate holds its first
message until the turns before it have ended. A turn runs from admission to the session's close; the
gate calls ``on_start`` as a turn begins (a fresh trunk optimizer, parallel's trunk copy) and ``on_end`` as it
ends (parallel's copy taken for the report), so the trunk sees the same turns, in the same order, from the
same states as when the turns were sent one by one: the same model.

A client that ends before its turn (its session closed or its reply came back without one: it failed) is
skipped when its turn comes, with both hooks called as for a turn with no steps, as the one-by-one round
does for a failed client. Only rounds whose jobs do not depend on each other can be sent at once:
``client_parts: share`` hands each client the parts of the one before, so it keeps one message per turn,
each through the gate as a round of one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("fedlm")

TurnHook = Callable[[str], None]


class TurnGate:
    """Admits a round's clients to the trunk one at a time, in the round's job order, and no one else: a
    session outside an open round, of a client not in it, or whose turn has passed is refused, so a straggler
    (a client whose reply the server stopped waiting for) cannot step the trunk during another's turn."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._order: list[str] = []
        self._next = 0  # index in _order of the turn running or due
        self._ended: set[str] = set()  # clients that ended before their turn came
        self._running: str | None = None
        self._on_start: TurnHook = no_turn_hook
        self._on_end: TurnHook = no_turn_hook
        self._open = False

    def open(self, order: list[str], on_start: TurnHook, on_end: TurnHook) -> None:
        """Start a round whose turns run in ``order``; the first is admitted at once."""
        if len(set(order)) != len(order):
            raise ValueError(f"a client appears twice in the round's order {order}")
        with self._changed:
            self._order, self._next, self._ended, self._running = list(order), 0, set(), None
            self._on_start, self._on_end, self._open = on_start, on_end, True
            self._advance()

    def close(self) -> None:
        """End the round; clients still waiting are refused (their turn will not come)."""
        with self._changed:
            self._open = False
            self._running = None
            self._changed.notify_all()

    def admit(self, client_id: str) -> bool:
        """Wait until ``client_id``'s turn; False if it is not in the open round, or the round closed or its
        turn passed first."""
        with self._changed:
            if not (self._open and client_id in self._order):
                return False
            self._changed.wait_for(lambda: not self._open or self._running == client_id or self._passed(client_id))
            return self._open and self._running == client_id

    def holds(self, client_id: str) -> bool:
        """Whether ``client_id``'s turn is the one running (checked before each of its messages)."""
        with self._changed:
            return self._open and self._running == client_id

    def end(self, client_id: str) -> None:
        """``client_id``'s turn is over (its session closed), or it will never take it (it failed)."""
        with self._changed:
            if not self._open or client_id not in self._order:
                return
            if self._running == client_id:
                self._finish(client_id)
                self._advance()
            elif not self._passed(client_id):
                self._ended.add(client_id)

    def _passed(self, client_id: str) -> bool:
        return self._order.index(client_id) < self._next

    def _finish(self, client_id: str) -> None:
        try:
            self._on_end(client_id)
        finally:
            self._running = None
            self._next += 1

    def _advance(self) -> None:
        """Start the next turn; clients that already ended take theirs empty, in order."""
        while self._next < len(self._order):
            client_id = self._order[self._next]
            self._running = client_id
            self._on_start(client_id)
            if client_id not in self._ended:
                log.info("trunk: turn of client %s", client_id)
                break
            self._finish(client_id)
        self._changed.notify_all()


def no_turn_hook(client_id: str) -> None:
    """Nothing to do as a turn starts or ends (turns sent one by one: the split executor does it around each)."""
    del client_id
