"""Test helpers for split learning: a message hook that records what crossed the boundary."""

from __future__ import annotations

import threading
from typing import NamedTuple


class Message(NamedTuple):
    direction: str  # fedlm.split.trunk.TO_SERVER or TO_CLIENT
    client_id: str
    kind: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]


class MessageLog:
    """A :data:`~fedlm.split.trunk.MessageHook` that keeps every message it sees, so a test can check what
    crossed."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._lock = threading.Lock()

    def __call__(self, direction: str, client_id: str, kind: str, tensors: dict) -> None:
        with self._lock:
            self.messages.append(Message(direction, client_id, kind, dict(tensors)))

    def names(self, direction: str) -> set[str]:
        """Every tensor name seen in one direction."""
        return {name for m in self.messages if m.direction == direction for name in m.tensors}
