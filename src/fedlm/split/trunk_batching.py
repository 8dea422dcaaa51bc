"""FL-GLM's client-batch trunk: the round's clients send one batch each, the trunk runs them as one batch
and steps once, and each client gets back its own slice of the output and of the input gradient.

It has the same ``forward``/``backward`` methods as :class:`~fedlm.split.trunk.TrunkBackend`, so both
transports carry it unchanged. A call blocks until every member of the round has sent its message (each
client is one gRPC session thread, or one thread of the simulator's driver); the last arrival runs the
trunk. Members come from the coordinator (:meth:`expect`); a client that finishes early or disconnects
leaves the batch (:meth:`drop`), and the others go on without it.

The trunk's gradient is the *mean* of the clients' gradients (each client's loss is a mean over its own
batch), so one client_batch step moves the trunk as one step on the union of the batches would, while the
gradient routed back to each client is that of its own loss, exactly as if it had the trunk to itself.
Sequences of different lengths are right-padded (hidden zeros, attention mask 0) for the concatenation
and cut back to each client's length.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from fedlm.models.cut import Activations
from fedlm.split.trunk import RejectedMessage, TrunkBackend, TrunkLimits, check_grad, check_step

__all__ = ["BatchingTrunkBackend", "concat_activations"]


@dataclasses.dataclass
class _Group:
    """One trunk step over several clients' batches, from the combined forward to the combined backward."""

    order: list[str]  # clients in concatenation order
    steps: dict[str, int]
    shapes: dict[str, tuple[int, int]]  # each client's (batch, seq)
    received: Tensor  # the combined trunk input (leaf collecting the input gradient)
    output: Tensor  # the combined trunk output, attached to the trunk's graph
    grads: dict[str, Tensor] = dataclasses.field(default_factory=dict)


class BatchingTrunkBackend(TrunkBackend):
    """Client-batch trunk mode; see the module docstring. ``timeout_s`` bounds how long a client waits for
    the others before its message is refused."""

    def __init__(
        self,
        trunk: nn.Module,
        hidden_size: int,
        optimizer: torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        max_grad_norm: float | None = None,
        wire_dtype: torch.dtype | None = None,
        precision: str = "fp32",
        timeout_s: float = 600.0,
        limits: TrunkLimits | None = None,
    ) -> None:
        super().__init__(trunk, hidden_size, optimizer, max_grad_norm=max_grad_norm, wire_dtype=wire_dtype,
                         precision=precision, limits=limits)
        self.timeout_s = timeout_s
        self._members: set[str] = set()
        self._forwards: dict[str, tuple[int, Activations]] = {}
        self._group: _Group | None = None
        self._forward_answers: dict[str, Tensor] = {}
        self._backward_answers: dict[str, Tensor] = {}
        self._cond = threading.Condition()

    def expect(self, client_ids: list[str]) -> None:
        """The clients whose batches make up each trunk step from now on (the round's sampled clients)."""
        with self._cond:
            if self._group is not None or self._forwards:
                raise RuntimeError("expect() while a client batch is in flight")
            self._members = set(client_ids)

    def forward(self, client_id: str, step: int, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        acts = self._check_activations(tensors)
        with self._cond:
            check_step(step)
            if client_id not in self._members:
                raise RejectedMessage(f"client {client_id} is not in this round's client batch")
            if client_id in self._forwards:
                raise RejectedMessage(f"client {client_id} already sent a forward for the next trunk step")
            if self._group is not None and client_id in self._group.order:
                raise RejectedMessage(f"client {client_id} must send the backward of step "
                                      f"{self._group.steps[client_id]} before a new forward")
            self._forwards[client_id] = (step, acts)
            self._fire_forward()
            if not self._cond.wait_for(lambda: client_id in self._forward_answers, self.timeout_s):
                self._forwards.pop(client_id, None)
                raise RejectedMessage(f"the other clients of the batch sent no forward within {self.timeout_s}s")
            return {"hidden": self._forward_answers.pop(client_id)}

    def backward(self, client_id: str, step: int, grad: Tensor) -> dict[str, Tensor]:
        with self._cond:
            group = self._group
            if group is None or group.steps.get(client_id) != check_step(step):
                raise RejectedMessage(f"no forward of client {client_id} step {step} awaits backward")
            if client_id in group.grads:
                raise RejectedMessage(f"client {client_id} already sent the backward of step {step}")
            check_grad(grad, step, (*group.shapes[client_id], self.hidden_size), group.output.dtype)
            group.grads[client_id] = grad
            self._fire_backward()
            if not self._cond.wait_for(lambda: client_id in self._backward_answers, self.timeout_s):
                group.grads.pop(client_id, None)
                raise RejectedMessage(f"the other clients of the batch sent no backward within {self.timeout_s}s")
            return {"grad": self._backward_answers.pop(client_id)}

    def drop(self, client_id: str) -> None:
        """The client left (finished its local steps, or its session ended): the batch goes on without it."""
        with self._cond:
            self._members.discard(client_id)
            self._forwards.pop(client_id, None)
            self._fire_backward()
            self._fire_forward()
            self._cond.notify_all()

    # ---------------------------------------------------------------------------------------- internals

    def _fire_forward(self) -> None:
        """Run the trunk once every member has a forward in and the previous step is done."""
        if self._group is not None or not self._forwards or not self._members <= set(self._forwards):
            return
        order = sorted(self._forwards)
        acts = [self._forwards[cid][1] for cid in order]
        combined = concat_activations(acts)
        received = Activations.from_dict({k: t.to(self._device) for k, t in combined.to_dict().items()}).detached()
        output = self._run(received)
        shapes = {cid: tuple(a.hidden.shape[:2]) for cid, a in zip(order, acts, strict=True)}
        self._group = _Group(order, {cid: self._forwards[cid][0] for cid in order}, shapes, received.hidden, output)
        start = 0
        for cid in order:
            batch, seq = shapes[cid]
            self._forward_answers[cid] = output[start : start + batch, :seq].detach().cpu()
            start += batch
        self._forwards.clear()
        self._cond.notify_all()

    def _fire_backward(self) -> None:
        """Backpropagate once every client of the step still present has sent its gradient."""
        group = self._group
        if group is None:
            return
        waiting = [cid for cid in group.order if cid in self._members and cid not in group.grads]
        if waiting:
            return
        grad = torch.zeros_like(group.output)
        start = 0
        for cid in group.order:
            batch, seq = group.shapes[cid]
            if cid in group.grads:  # a client that left mid-step contributes nothing
                grad[start : start + batch, :seq] = group.grads[cid].to(grad.device)
            start += batch
        group.output.backward(grad)
        contributors = max(len(group.grads), 1)
        for p in self.trunk.parameters():
            if p.grad is not None:
                p.grad.div_(contributors)
        self._step()
        start = 0
        for cid in group.order:
            batch, seq = group.shapes[cid]
            if cid in group.grads:
                self._backward_answers[cid] = group.received.grad[start : start + batch, :seq].cpu()
            start += batch
        self._group = None
        self._cond.notify_all()
        self._fire_forward()


def concat_activations(parts: list[Activations]) -> Activations:
    """Stack several clients' activations along the batch, right-padding shorter sequences (hidden zeros,
    attention mask 0, positions continued) so that no real token attends to padding."""
    seq = max(a.hidden.shape[1] for a in parts)
    hidden = torch.cat([_pad(a.hidden, seq, 0.0) for a in parts])
    mask = None
    if any(a.attention_mask is not None for a in parts) or any(a.hidden.shape[1] != seq for a in parts):
        masks = [a.attention_mask if a.attention_mask is not None
                 else torch.ones(a.hidden.shape[:2], dtype=torch.long) for a in parts]
        mask = torch.cat([_pad(m.to(torch.long), seq, 0) for m in masks])
    positions = None
    if any(a.position_ids is not None for a in parts):
        rows = []
        for a in parts:
            batch, length = a.hidden.shape[:2]
            pos = a.position_ids if a.position_ids is not None else torch.arange(length)[None]
            pos = pos.expand(batch, length)
            tail = pos[:, -1:] + torch.arange(1, seq - length + 1)[None]
            rows.append(torch.cat([pos, tail], dim=1))
        positions = torch.cat(rows)
        if (positions == positions[:1]).all():
            positions = positions[:1]  # one row for everyone, as the unsplit model passes it
    return Activations(hidden, mask, positions)


def _pad(tensor: Tensor, seq: int, value: float) -> Tensor:
    missing = seq - tensor.shape[1]
    if missing == 0:
        return tensor
    shape = (tensor.shape[0], missing, *tensor.shape[2:])
    return torch.cat([tensor, torch.full(shape, value, dtype=tensor.dtype)], dim=1)
