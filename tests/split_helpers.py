"""Test helpers for split learning: a message hook that records what crossed the boundary, a network hop for
activations, and one training step (or one step's gradients) taken split and unsplit."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from fedlm.models.cut import Activations, Cut, SplitModel
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


def assert_split_step_equals_unsplit(task: Task, batch: dict, reference: torch.nn.Module, cut: Cut) -> Activations:
    """One SGD step (lr 1) of ``reference`` on ``batch``, and the same step cut at ``cut`` on a copy, with the
    task's targets kept on the client's top: loss and every weight after the step agree to 1e-5. Returns what
    the client's bottom sent."""
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
    return sent



def wire(acts: Activations) -> Activations:
    """A network hop: serialise, copy, and receive as a leaf that needs a gradient."""
    return Activations.from_dict({name: t.detach().clone() for name, t in acts.to_dict().items()}).detached()


def assert_split_grads_equal_unsplit(model: torch.nn.Module, cut: Cut, ids: torch.Tensor, mask: torch.Tensor,
                                     loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                                     ) -> tuple[SplitModel, dict[str, torch.Tensor]]:
    """``loss_fn(logits, mask)`` backpropagated through the whole ``model``, then through ``model`` cut at ``cut``
    with activations and gradients crossing :func:`wire`: the losses agree to 1e-5, the same parameters get
    gradients and every gradient agrees (rtol 1e-4, atol 1e-5). Returns the split model and its gradients."""
    whole = loss_fn(model(input_ids=ids, attention_mask=mask).logits, mask)
    whole.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    split = SplitModel(model, cut)
    sent = split.bottom(ids, mask)
    received = wire(sent)
    out = split.trunk(received)
    top_in = wire(out)
    loss = loss_fn(split.top.logits(split.top(top_in), ids), mask)
    loss.backward()
    out.hidden.backward(top_in.hidden.grad)
    if sent.hidden.requires_grad:  # else the bottom is frozen embeddings: nothing to send a gradient to
        sent.hidden.backward(received.hidden.grad)

    torch.testing.assert_close(loss, whole, rtol=0, atol=1e-5)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    return split, got
