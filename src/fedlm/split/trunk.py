"""The server's side of the split boundary: the trunk, the checks on what clients send, and one message's
handling for every transport.

One training step, as the client drives it through a :class:`~fedlm.split.transport.Transport`::

    sent = split.bottom(input_ids, attention_mask)     # client
    top_in = transport.forward(step, sent)              # server: trunk forward
    loss = loss_fn(split.top(top_in))                   # client
    loss.backward()                                     # client: top grads + top_in.hidden.grad
    grad = transport.backward(step, top_in.hidden.grad) # server: trunk backward + optimizer step
    sent.hidden.backward(grad)                          # client: bottom grads

Every message is serialised with :mod:`fedlm.split.wire`, in process too, so byte counts and validation
are the same whichever transport carries them. The client side never holds trunk parameters; the server
side never sees token ids or labels: a forward carries only ``hidden``, ``attention_mask`` and
``position_ids``, a backward only ``grad``, and anything else is refused.

No valid client can hold the trunk for long: :class:`TrunkLimits` bounds each message (tokens per sequence
by the model's positions and the run's ``max_length``, batch x sequence by the run's batch size), and
messages compute one at a time in round-robin turns across clients (:class:`~fedlm.split.fair.RoundRobin`),
so a client waits for at most one bounded message of each other client.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from fedlm.federation.local_training import clip_and_step
from fedlm.models.cut import Activations
from fedlm.models.device import autocast
from fedlm.split import wire
from fedlm.split.fair import RoundRobin

__all__ = [
    "FORWARD_NAMES",
    "WIRE_DTYPES",
    "MessageHook",
    "RejectedMessage",
    "TrunkBackend",
    "TrunkLimits",
    "check_grad",
    "check_step",
    "handle_request",
    "message_precision",
]

log = logging.getLogger("fedlm")

FORWARD_NAMES = ("hidden", "attention_mask", "position_ids")
# Precisions activations and their gradients may cross the boundary in; the trunk computes in its own
# dtype whatever the wire carries, and answers in the precision it was asked in.
WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                       "bfloat16": torch.bfloat16}
TO_SERVER, TO_CLIENT = "client->server", "server->client"
KINDS = ("forward", "backward")

# (direction, client_id, kind, {name: (dtype, shape)}); direction is TO_SERVER or TO_CLIENT
MessageHook = Callable[[str, str, str, dict[str, tuple[str, tuple[int, ...]]]], None]


class RejectedMessage(ValueError):
    """The server refused a message (wrong names, shapes, dtypes, values or step); the message says why."""


@dataclasses.dataclass(frozen=True)
class TrunkLimits:
    """The most one forward may ask of the trunk (None: unbounded). A message beyond them is refused before
    any compute, with the limit and what to change in the refusal."""

    max_seq_len: int | None = None  # tokens per sequence: the model's positions, the run's max_length
    max_tokens: int | None = None  # batch x sequence in one message
    max_position: int | None = None  # position ids stay below the model's positions

    @classmethod
    def for_model(cls, model_config: object, max_length: int | None, batch_size: int) -> TrunkLimits:
        """What a client of this run can legitimately send: sequences no longer than the model's positions
        (and ``max_length``, when known), and one training batch of them per message."""
        positions = getattr(model_config, "max_position_embeddings", None)
        bounds = [v for v in (positions, max_length) if v]
        seq = min(bounds) if bounds else None
        return cls(seq, None if seq is None else seq * batch_size, positions)

    def check(self, batch: int, seq: int, positions: Tensor | None) -> None:
        if self.max_seq_len is not None and seq > self.max_seq_len:
            raise RejectedMessage(f"sequences of {seq} tokens exceed this trunk's limit of {self.max_seq_len} "
                                  "(the model's positions / the run's max_length); send shorter sequences")
        if self.max_tokens is not None and batch * seq > self.max_tokens:
            raise RejectedMessage(f"{batch} x {seq} = {batch * seq} tokens exceed this trunk's limit of "
                                  f"{self.max_tokens} per message (batch x sequence); send smaller batches")
        if self.max_position is not None and positions is not None and int(positions.max()) >= self.max_position:
            raise RejectedMessage(f"position_ids reach {int(positions.max())}; this model has "
                                  f"{self.max_position} positions")

    def max_message_bytes(self, hidden_size: int, overhead: int = 64 * 1024) -> int | None:
        """The largest message a client within these limits sends or gets: a float32 forward (hidden, int64
        mask and positions) or backward, plus framing."""
        if self.max_tokens is None:
            return None
        return self.max_tokens * (4 * hidden_size + 16) + overhead


@dataclasses.dataclass
class _Pending:
    received: Tensor  # the trunk's input, a leaf that collects the gradient to send back
    output: Tensor  # the trunk's output, still attached to the trunk's graph


class TrunkBackend:
    """The server's side of split learning, independent of any transport: the single place where trunk
    compute happens.

    It holds the trunk and its optimizer, validates what clients send, and keeps each (client, step)'s
    forward graph until that step's backward arrives. A refused message raises :class:`RejectedMessage`
    before anything is computed, so the trunk's weights and other clients' pending steps are untouched.

    One trunk, stepped by each client's backward in turn, one message at a time in round-robin turns across
    clients (``limits`` bounds each message; see the module docstring), so concurrent clients are safe. A
    backward applies the gradient of the weights its forward saw, so when a step changes the weights every
    other pending forward is dropped (its backward is then refused, and the client runs that forward again);
    a round engine lets one client at a time run forward-backward. The trunk modes *sequential* and
    *parallel* use this backend (parallel reloads the round's trunk before each client's turn, see
    :mod:`fedlm.split.modes`); *client batch* is :class:`~fedlm.split.trunk_batching.BatchingTrunkBackend`,
    with the same ``forward``/``backward`` methods, so transports and clients do not change.

    ``wire_dtype``, if given, is the one precision activations and gradients may arrive in (the config's
    ``split.activation_dtype``); a message in another is refused. Without it any of :data:`WIRE_DTYPES`
    is taken.

    The trunk computes on its parameters' device, under ``precision``'s autocast (the config's
    ``train.precision``, fp32 or bf16); what it receives and answers stays on the CPU in the parameters' dtype,
    which the wire then carries in ``wire_dtype``.
    """

    def __init__(
        self,
        trunk: nn.Module,
        hidden_size: int,
        optimizer: torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        *,
        max_pending_per_client: int = 4,
        max_grad_norm: float | None = None,
        wire_dtype: torch.dtype | None = None,
        precision: str = "fp32",
        limits: TrunkLimits | None = None,
    ) -> None:
        if wire_dtype is not None and wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype {wire_dtype} is not one of {', '.join(WIRE_DTYPES)}")
        self.trunk = trunk
        self.hidden_size = hidden_size
        params = list(trunk.parameters())
        if not params:
            raise ValueError("the trunk has no parameters")
        self._make_optimizer = None if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        self.optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(params)
        self.max_pending_per_client = max_pending_per_client
        self.max_grad_norm = max_grad_norm
        self.wire_dtype = wire_dtype
        self.precision = precision
        floating = next((p for p in params if p.is_floating_point()), params[0])  # not a quantized base's packing
        self.compute_dtype, self._device = floating.dtype, floating.device
        self.limits = limits or TrunkLimits()
        self._pending: dict[tuple[str, int], _Pending] = {}
        self._turns = RoundRobin()

    def reset_optimizer(self) -> None:
        """A fresh optimizer (a new client turn or round starts without the last one's moments)."""
        if self._make_optimizer is None:
            raise ValueError("reset_optimizer needs the backend built with an optimizer factory")
        self.optimizer = self._make_optimizer([p for p in self.trunk.parameters() if p.requires_grad])

    def _step(self) -> None:
        """Clip (if asked) and apply the trunk's accumulated gradient."""
        clip_and_step(self.optimizer, self.trunk.parameters(), self.max_grad_norm)
        self.optimizer.zero_grad()

    def _run(self, received: Activations) -> Tensor:
        """The trunk's output hidden states, attached to its graph, in the parameters' dtype whatever autocast
        computed (so a client's gradient for them is checked against, and flows back in, that dtype).

        Grad mode is per thread, and an in-process caller may be under no_grad: hence enable_grad. The input
        enters as a view of the received leaf: autocast caches its 16-bit cast of a leaf that needs grad (meant
        for weights), which would sum the gradients of the input's several uses in 16 bits, where the unsplit
        model sums them in 32."""
        with torch.enable_grad(), autocast(self._device, self.precision):
            hidden = received.hidden.view_as(received.hidden)
            return self.trunk(dataclasses.replace(received, hidden=hidden)).hidden.to(self.compute_dtype)

    def forward(self, client_id: str, step: int, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Run the trunk on a client's activations; keep the graph for :meth:`backward`."""
        acts = self._check_activations(tensors)
        with self._turns.turn(client_id):
            key = (client_id, check_step(step))
            if key in self._pending:
                raise RejectedMessage(f"step {step} of client {client_id} already has a forward awaiting backward")
            waiting = sum(1 for cid, _ in self._pending if cid == client_id)
            if waiting >= self.max_pending_per_client:
                raise RejectedMessage(
                    f"client {client_id} already has {waiting} forwards awaiting backward (at most "
                    f"{self.max_pending_per_client})"
                )
            received = Activations.from_dict({name: t.to(self._device) for name, t in acts.to_dict().items()})
            received = received.detached()
            output = self._run(received)
            self._pending[key] = _Pending(received.hidden, output)
            return {"hidden": output.detach().cpu()}

    def backward(self, client_id: str, step: int, grad: Tensor) -> dict[str, Tensor]:
        """Backpropagate the client's gradient w.r.t. the trunk output, step the optimizer (clipping the
        trunk's gradient norm if ``max_grad_norm``), and return the gradient w.r.t. the trunk input."""
        with self._turns.turn(client_id):
            key = (client_id, check_step(step))
            pending = self._pending.get(key)
            if pending is None:
                raise RejectedMessage(
                    f"no forward of client {client_id} step {step} awaits backward (never sent, already used, "
                    "or dropped because the trunk stepped since; run the forward again)"
                )
            check_grad(grad, step, tuple(pending.output.shape), pending.output.dtype)
            del self._pending[key]
            pending.output.backward(grad.to(self._device))
            self._step()
            stale = list(self._pending)
            self._pending.clear()  # their graphs hold the weights before this step
            if stale:
                log.info("trunk: step of client %s dropped stale forwards %s", client_id, stale)
            return {"grad": pending.received.grad.cpu()}

    def drop(self, client_id: str) -> None:
        """Forget a client's pending forwards (its session ended)."""
        with self._turns.turn(client_id):
            for key in [key for key in self._pending if key[0] == client_id]:
                del self._pending[key]

    def _check_activations(self, tensors: Mapping[str, Tensor]) -> Activations:
        unexpected = sorted(set(tensors) - set(FORWARD_NAMES))
        if unexpected:
            raise RejectedMessage(f"unexpected tensors {unexpected} in a forward (allowed: {', '.join(FORWARD_NAMES)})")
        hidden = tensors.get("hidden")
        if hidden is None:
            raise RejectedMessage("a forward needs 'hidden'")
        if hidden.dim() != 3 or hidden.shape[0] < 1 or hidden.shape[1] < 1 or hidden.shape[2] != self.hidden_size:
            raise RejectedMessage(
                f"hidden has shape {tuple(hidden.shape)}; expected (batch, seq, {self.hidden_size}), batch and seq >= 1"
            )
        if hidden.dtype != self.compute_dtype:
            raise RejectedMessage(f"hidden is {hidden.dtype}; this trunk computes in {self.compute_dtype}")
        batch, seq = hidden.shape[:2]
        self.limits.check(batch, seq, None)  # before the value scans below: they cost time too
        _check_finite("hidden", hidden)
        mask = tensors.get("attention_mask")
        if mask is not None:
            if mask.dtype not in (torch.int64, torch.bool) or tuple(mask.shape) != (batch, seq):
                raise RejectedMessage(
                    f"attention_mask is {mask.dtype} {tuple(mask.shape)}; expected int64 or bool ({batch}, {seq})"
                )
            if not ((mask == 0) | (mask == 1)).all():
                raise RejectedMessage("attention_mask holds values other than 0 and 1")
        positions = tensors.get("position_ids")
        if positions is not None:
            if positions.dtype != torch.int64 or positions.dim() != 2 or positions.shape[0] not in (1, batch) or (
                positions.shape[1] != seq
            ):
                raise RejectedMessage(
                    f"position_ids is {positions.dtype} {tuple(positions.shape)}; expected int64 (1 or {batch}, {seq})"
                )
            if (positions < 0).any():
                raise RejectedMessage("position_ids holds negative positions")
            self.limits.check(batch, seq, positions)
        return Activations(hidden, mask, positions)


def check_step(step: int) -> int:
    """A message's step number: an integer >= 0."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise RejectedMessage(f"step must be an integer >= 0, got {step!r}")
    return step


def check_grad(grad: Tensor, step: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A backward's gradient must match the trunk output it answers: shape, dtype, finite values."""
    if not isinstance(grad, Tensor) or tuple(grad.shape) != shape:
        got = tuple(grad.shape) if isinstance(grad, Tensor) else type(grad).__name__
        raise RejectedMessage(f"grad has shape {got}, the trunk output of step {step} has {shape}")
    if grad.dtype != dtype:
        raise RejectedMessage(f"grad is {grad.dtype}, the trunk output is {dtype}")
    _check_finite("grad", grad)


def _check_finite(name: str, tensor: Tensor) -> None:
    if not tensor.is_floating_point():
        raise RejectedMessage(f"{name} is {tensor.dtype}, not a floating-point tensor")
    if not torch.isfinite(tensor).all():
        raise RejectedMessage(f"{name} holds NaN or infinite values")


def handle_request(
    backend: TrunkBackend, client_id: str, kind: str, step: int, payload: bytes, hook: MessageHook | None = None
) -> bytes:
    """Server side of one message, for every transport: decode, check, run the backend, encode the answer.

    Raises :class:`fedlm.split.wire.WireError` or :class:`RejectedMessage` (both ``ValueError``) with the
    reason; nothing reaches the backend unless the payload decodes and carries the right names.
    """
    tensors = wire.decode(payload)
    if hook is not None:
        hook(TO_SERVER, client_id, kind, wire.describe(tensors))
    precision = message_precision(tensors)
    if backend.wire_dtype is not None and wire.float_dtypes(tensors) and precision != backend.wire_dtype:
        raise RejectedMessage(f"the {kind} travels in {precision}; this trunk takes activations and gradients "
                              f"in {backend.wire_dtype}")
    tensors = wire.cast_floats(tensors, backend.compute_dtype)
    if kind == "forward":
        answer = backend.forward(client_id, step, tensors)
    elif kind == "backward":
        if set(tensors) != {"grad"}:
            raise RejectedMessage(f"a backward carries only 'grad', got {sorted(tensors)}")
        answer = backend.backward(client_id, step, tensors["grad"])
    else:
        raise RejectedMessage(f"unknown message kind {kind!r} (expected {' or '.join(KINDS)})")
    answer = wire.cast_floats(answer, precision)
    if hook is not None:
        hook(TO_CLIENT, client_id, kind, wire.describe(answer))
    return wire.encode(answer)


def message_precision(tensors: Mapping[str, Tensor]) -> torch.dtype:
    """The one floating-point dtype a message's tensors travel in (float32 if it has none); the answer goes
    back in it too. A message mixing several is refused."""
    floats = wire.float_dtypes(tensors)
    if len(floats) > 1:
        raise RejectedMessage(f"a message mixes floating-point dtypes {sorted(map(str, floats))}; send one")
    return floats.pop() if floats else torch.float32
