"""Who owns which parameters in split learning: the client's bottom and top, the server's trunk, and which
client parameters leave the client (shared) or never do (local)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fedlm.errors import UserError
from fedlm.federation.sharing import SharingPolicy
from fedlm.models.cut import SplitModel

CLIENT_PARTS = ("share", "average_bottom", "average", "local")


@dataclass(frozen=True)
class SplitParts:
    """The model's trainable parameter names by owner, and which client parameters leave the client."""

    bottom: list[str]
    top: list[str]
    trunk: list[str]
    shared: list[str]  # client parameters averaged or passed on
    local: list[str]  # client parameters that never leave their client

    def policy(self) -> SharingPolicy:
        """The engine's view: the trunk and the shared client parts are global, the rest local."""
        return SharingPolicy(self.trunk + self.shared, self.local)


def split_parts(split: SplitModel, client_parts: str) -> SplitParts:
    if client_parts not in CLIENT_PARTS:
        raise UserError(f"split.client_parts = {client_parts!r}; choose one of {', '.join(CLIENT_PARTS)}")
    bottom = split.bottom_parameter_names()
    top = [n for n in split.client_parameter_names() if n not in set(bottom)]  # tied weights count as bottom
    shared = {"share": bottom + top, "average": bottom + top, "average_bottom": bottom, "local": []}[client_parts]
    local = [n for n in bottom + top if n not in set(shared)]
    return SplitParts(bottom, top, split.trunk_parameter_names(), shared, local)


def client_copy(split: SplitModel) -> SplitModel:
    """A client's own model: its bottom and top are real, every trunk parameter is an empty ``meta`` tensor,
    so the client holds no trunk weights (and could not run the trunk if it tried)."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in split.trunk_parameters()}
    return SplitModel(copy.deepcopy(split.model, memo), split.cut)
