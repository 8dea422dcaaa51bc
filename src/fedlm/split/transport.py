"""The client's side of the split boundary: a :class:`Transport` carries one client's forward and backward
messages to the trunk, counting their exact bytes.

``InProcessTransport`` calls a :class:`~fedlm.split.trunk.TrunkBackend` in this process through the same
serialisation and checks as the network; :class:`~fedlm.split.grpc_client.GrpcTransport` reaches a trunk over gRPC.
Both are a :class:`ClientSide`, which owns what they share: precision, encoding, byte counts and hooks.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
from typing import Protocol

import torch
from torch import Tensor

from fedlm.models.cut import Activations
from fedlm.split import wire
from fedlm.split.trunk import (
    TO_CLIENT,
    TO_SERVER,
    WIRE_DTYPES,
    MessageHook,
    RejectedMessage,
    TrunkBackend,
    handle_request,
    message_precision,
)

log = logging.getLogger("fedlm")


class TransportError(RuntimeError):
    """Client side: the trunk server refused a message or could not be reached; carries the server's reason."""


class Transport(Protocol):
    """The client's view of the trunk: send activations, get the trunk output; send its gradient, get the
    gradient w.r.t. what was sent. ``bytes_sent``/``bytes_received`` count the exact wire payloads."""

    bytes_sent: int
    bytes_received: int

    def forward(self, step: int, acts: Activations) -> Activations: ...

    def backward(self, step: int, grad: Tensor) -> Tensor: ...

    def close(self) -> None: ...


class ClientSide(abc.ABC):
    """What both transports share: encoding, counting, hooks, and turning answers into client values."""

    def __init__(self, client_id: str, hook: MessageHook | None, wire_dtype: torch.dtype = torch.float32) -> None:
        if wire_dtype not in WIRE_DTYPES.values():
            raise ValueError(f"wire_dtype {wire_dtype} is not one of {', '.join(WIRE_DTYPES)}")
        self.client_id = client_id
        self.wire_dtype = wire_dtype
        self.bytes_sent = 0
        self.bytes_received = 0
        self._hook = hook
        self._lock = threading.Lock()  # one exchange at a time: answers come back in order
        self._closed = False

    def forward(self, step: int, acts: Activations) -> Activations:
        """The trunk output as a leaf needing grad, with the client's own mask and positions reattached,
        so the client's ``loss.backward()`` leaves in ``.hidden.grad`` what :meth:`backward` sends."""
        answer = self._call("forward", step, acts.to_dict(), expect="hidden")
        return dataclasses.replace(acts, hidden=answer.requires_grad_(True))

    def backward(self, step: int, grad: Tensor) -> Tensor:
        """The gradient w.r.t. the hidden states the client sent at ``step``."""
        return self._call("backward", step, {"grad": grad}, expect="grad")

    def _call(self, kind: str, step: int, tensors: dict[str, Tensor], expect: str) -> Tensor:
        """One exchange; floating-point tensors cross in ``wire_dtype`` and come back in the caller's dtype."""
        compute = message_precision(tensors)
        tensors = wire.cast_floats(tensors, self.wire_dtype)
        payload = wire.encode(tensors)
        with self._lock:
            if self._closed:
                raise TransportError(f"the {kind} of step {step} came after the session was closed")
            if self._hook is not None:
                self._hook(TO_SERVER, self.client_id, kind, wire.describe(tensors))
            self.bytes_sent += len(payload)
            reply = self._exchange(kind, step, payload)
            self.bytes_received += len(reply)
            try:
                answer = wire.decode(reply)
            except wire.WireError as err:
                raise TransportError(f"trunk server sent an unreadable {kind} answer: {err}") from None
            if self._hook is not None:
                self._hook(TO_CLIENT, self.client_id, kind, wire.describe(answer))
        if set(answer) != {expect}:
            raise TransportError(f"trunk server answered a {kind} with {sorted(answer)}, expected ['{expect}']")
        return answer[expect].to(compute)

    @abc.abstractmethod
    def _exchange(self, kind: str, step: int, payload: bytes) -> bytes:
        """Deliver one request payload, return the answer payload; raise :class:`TransportError`."""

    def close(self) -> None:
        """End the session once any exchange in flight has its answer; later calls raise
        :class:`TransportError`, so a client abandoned at its deadline cannot reach the trunk again."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._end()

    @abc.abstractmethod
    def _end(self) -> None:
        """Release the session's resources (called once)."""


class InProcessTransport(ClientSide):
    """Calls a :class:`TrunkBackend` in this process, through the same serialisation and checks as gRPC
    (so simulations count the same bytes and refuse the same messages as a deployment)."""

    def __init__(self, backend: TrunkBackend, client_id: str, *, hook: MessageHook | None = None,
                 wire_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(client_id, hook, wire_dtype)
        self._backend = backend

    def _exchange(self, kind: str, step: int, payload: bytes) -> bytes:
        try:
            return handle_request(self._backend, self.client_id, kind, step, payload)
        except (wire.WireError, RejectedMessage) as err:
            log.warning("trunk: rejected a %s of step %s from client %s: %s", kind, step, self.client_id, err)
            raise TransportError(f"trunk refused the {kind} of step {step}: {err}") from None

    def _end(self) -> None:
        """Forget this client's pending forwards on the backend."""
        self._backend.drop(self.client_id)


class InProcessConnections:
    """Opens an :class:`InProcessTransport` to ``backend`` per client session (the simulator's default); the
    hook sees each message as the client sends and receives it. Same constructor and calls as
    :class:`~fedlm.split.grpc_client.LoopbackGrpc`, so the simulator picks either from ``split.transport``."""

    def __init__(self, backend: TrunkBackend, client_ids: list[str], hook: MessageHook | None,
                 wire_dtype: torch.dtype = torch.float32) -> None:
        del client_ids  # any client may connect in process
        self._backend = backend
        self._hook = hook
        self._wire_dtype = wire_dtype

    def __call__(self, client_id: str) -> InProcessTransport:
        return InProcessTransport(self._backend, client_id, hook=self._hook, wire_dtype=self._wire_dtype)

    def close(self) -> None:
        """Nothing to release: each transport ends its own session."""
