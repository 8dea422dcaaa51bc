"""What the robust rules share: they need every update of the round at once, so they hold them.

A robust rule (median, trimmed mean, Krum, adaptive norm bounding) looks at all of a round's updates together;
unlike FedAvg's running sum, memory grows with the clients per round. When several processes share a round
(``fedlm run --workers``) ``merge`` gathers every process's updates, so each process computes the same result
from the same updates in the same (client id) order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from fedlm.federation.params import NamedTensors
from fedlm.federation.strategies.base import ClientUpdate

if TYPE_CHECKING:
    from fedlm.federation.collective import Collective


class HeldUpdates:
    """A round's updates, held until the rule reads them all; ``result`` is the rule's."""

    def __init__(self, current: NamedTensors) -> None:
        self.current = current
        self.updates: list[ClientUpdate] = []

    def add(self, update: ClientUpdate) -> None:
        """Hold a copy: the simulator's reports share the model's storage until its next client trains."""
        self.updates.append(dataclasses.replace(update, params={n: t.clone() for n, t in update.params.items()}))

    def merge(self, collective: Collective) -> None:
        parts = collective.all_gather(self.updates)
        self.updates = sorted((u for part in parts for u in part), key=lambda u: u.client_id)

    @property
    def sent(self) -> set[str]:
        """The names some client sent (a tensor everyone froze keeps its current value)."""
        return {name for update in self.updates for name in update.params}

    def ordered(self) -> list[ClientUpdate]:
        """The updates in client id order, whatever order they arrived in (the result must not depend on it)."""
        return sorted(self.updates, key=lambda u: u.client_id)

    def stacks(self) -> Iterator[tuple[str, torch.Tensor, list[ClientUpdate], torch.Tensor | None]]:
        """For each current tensor: its name, its current value, the updates that sent it (client id order) and
        their values stacked along a new first axis (float64; None if nobody sent it)."""
        ordered = self.ordered()
        for name, value in self.current.items():
            senders = [u for u in ordered if name in u.params]
            yield name, value, senders, torch.stack([u.params[name].double() for u in senders]) if senders else None

    def per_tensor(self, combine: Callable[[torch.Tensor], torch.Tensor]) -> NamedTensors:
        """``combine(stack)`` for each tensor some client sent, in the tensor's dtype; the others keep their current
        value."""
        return {name: value if stack is None else combine(stack).to(value.dtype)
                for name, value, _, stack in self.stacks()}
