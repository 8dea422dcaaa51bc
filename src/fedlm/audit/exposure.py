"""What each protocol exposes to the server, checked on real messages: the "never" rows of the README's
table (labels, token ids) must not appear in anything the server receives.

Split learning's boundary messages are seen through the executor's message hook (the tensors' names,
dtypes and shapes, as the wire decodes them); a FedAvg upload is seen as the server decodes it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from fedlm.federation.params import NamedTensors
from fedlm.models.cut import Activations
from fedlm.split.trunk import TO_SERVER

# what the server may receive across the split boundary, per message kind (Activations' fields; the gradient)
BOUNDARY_FIELDS = {"forward": {"hidden", "attention_mask", "position_ids"}, "backward": {"grad"}}
INTEGER_FIELDS = {"attention_mask", "position_ids"}  # integer tensors allowed: neither is text


class MessageLog:
    """A split executor's message hook that keeps what reached the server: {kind: {name: dtype}}."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, set[str]]] = {}
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, direction: str, client_id: str, kind: str, tensors: dict) -> None:
        if direction != TO_SERVER:
            return
        with self._lock:
            self.count += 1
            fields = self.seen.setdefault(kind, {})
            for name, (dtype, _shape) in tensors.items():
                fields.setdefault(name, set()).add(dtype)

    def as_dict(self) -> dict[str, dict[str, list[str]]]:
        return {kind: {n: sorted(d) for n, d in fields.items()} for kind, fields in self.seen.items()}


def boundary_violations(log: MessageLog) -> list[str]:
    """Why the split messages the server received break the "never" rows (empty: they do not)."""
    problems = []
    for kind, fields in log.seen.items():
        allowed = BOUNDARY_FIELDS.get(kind, set())
        for name, dtypes in fields.items():
            if name not in allowed:
                problems.append(f"a {kind} message carried {name!r}, which is not one of {sorted(allowed)}")
            elif any(not d.startswith(("float", "bfloat")) for d in dtypes) and name not in INTEGER_FIELDS:
                problems.append(f"a {kind} message carried {name!r} as {sorted(dtypes)}: an integer tensor "
                                "that is neither a padding mask nor positions")
    return problems


def activation_violations(sent: Activations, input_ids: torch.Tensor) -> list[str]:
    """Value-level check of one forward message (what a transport encodes, ``sent.to_dict()``): its integer
    tensors are a 0/1 padding mask and positions, never the token ids."""
    problems = []
    for name, tensor in sent.to_dict().items():
        if tensor.is_floating_point():
            continue
        if tensor.shape == input_ids.shape and torch.equal(tensor.cpu(), input_ids.cpu()) and input_ids.max() > 1:
            problems.append(f"the forward message's {name!r} equals the batch's token ids")
        if name == "attention_mask" and not bool(((tensor == 0) | (tensor == 1)).all()):
            problems.append("the forward message's attention_mask holds values other than 0 and 1")
        if name == "position_ids" and int(tensor.max()) >= tensor.shape[-1]:
            problems.append("the forward message's position_ids exceed the sequence length")
    return problems


def upload_violations(received: NamedTensors, parameter_names: set[str], metrics: Mapping[str, object]) -> list[str]:
    """Why a decoded FedAvg-family upload breaks the "never" rows: every tensor must be a model parameter in
    floating point, and the metrics plain numbers."""
    problems = []
    for name, tensor in received.items():
        if name not in parameter_names:
            problems.append(f"the upload carried {name!r}, which is not a model parameter")
        elif not tensor.is_floating_point():
            problems.append(f"the upload carried {name!r} as {tensor.dtype}, not floating point")
    for key, value in metrics.items():
        if not isinstance(value, int | float):
            problems.append(f"the upload's metric {key!r} is a {type(value).__name__}, not a number")
    return problems
