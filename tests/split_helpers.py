"""Test helpers for split learning: a message hook that records what crossed the boundary, and one training
step taken split and unsplit."""

from __future__ import annotations

import copy
import threading
from typing import NamedTuple

import torch

from fedlm.models.cut import Cut, SplitModel
from fedlm.tasks import Task


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


def assert_split_step_equals_unsplit(task: Task, batch: dict, reference: torch.nn.Module, cut: Cut) -> None:
    """One SGD step (lr 1) of ``reference`` on ``batch``, and the same step cut at ``cut`` on a copy, with the
    task's targets kept on the client's top: loss and every weight after the step agree to 1e-5."""
    model = copy.deepcopy(reference)
    torch.manual_seed(5)
    ref_loss, _ = task.loss(reference, batch)
    ref_loss.backward()
    torch.optim.SGD(reference.parameters(), lr=1.0).step()

    split = SplitModel(model, cut)
    torch.manual_seed(5)
    sent = split.bottom(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    received = sent.detached()
    out = split.trunk(received)
    top_in = out.detached()
    loss, _ = task.loss_from_hidden(split.model, split.top(top_in), batch)
    loss.backward()
    out.hidden.backward(top_in.hidden.grad)
    sent.hidden.backward(received.hidden.grad)
    torch.optim.SGD(split.client_parameters() + split.trunk_parameters(), lr=1.0).step()

    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)

