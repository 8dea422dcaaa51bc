"""Who owns which parameters in split learning, and what happens to the client's.

The client holds its bottom and top, the server the trunk (:class:`SplitParts`). A parts policy
(:data:`PARTS_POLICIES`, the config's ``split.client_parts``) decides which client parameters leave the client
and how they come back into the global model (not to be confused with the engine's
:class:`~fedlm.federation.sharing.SharingPolicy`, which a split run derives from :class:`SplitParts`):

* ``share`` (FedBERT's Head-Emd Share): bottom and top are handed from client to client through the server;
  each client starts from the parts the previous one finished with, and the last one's are the round's;
* ``average`` (Head-Emd Avg): bottom and top go into every report and FedAvg averages them;
* ``average_bottom`` (EmdAvg): the bottom is averaged, each client keeps its own top;
* ``local``: both stay with each client.
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import ClassVar

import torch

from fedlm.config import SplitConfig
from fedlm.federation.params import NamedTensors, trainable_names
from fedlm.models.cut import Cut, SplitModel


@dataclass(frozen=True)
class SplitParts:
    """The model's trainable parameter names by owner, and which client parameters leave the client."""

    bottom: list[str]
    top: list[str]
    trunk: list[str]
    shared: list[str]  # client parameters averaged or passed on
    local: list[str]  # client parameters that never leave their client


class PartsPolicy(abc.ABC):
    """A parts policy: which client parameters are shared, and what a client's upload of them becomes. The
    split executor calls it around each turn: what the turn's clients start from (``relayed``, before), what
    their reports carry (``take``, after), and what the server hands to the global model (``server_params``).

    By default each report carries the uploaded parts into FedAvg's average; a policy that hands them on
    instead keeps them (``take``) and gives the last ones to the global model itself (``server_params``).
    """

    relays: ClassVar[bool] = False  # the parts travel from client to client, not into an average

    @classmethod
    @abc.abstractmethod
    def shared(cls, bottom: list[str], top: list[str]) -> list[str]:
        """The client parameter names that leave the client."""

    def begin_round(self) -> None:
        """A round (or a retried attempt) starts from the global model's parts."""
        return None  # nothing handed on to forget

    def relayed(self) -> NamedTensors | None:
        """The parts the next turn's clients start from instead of the round's, if any."""
        return None

    def take(self, uploaded: NamedTensors) -> NamedTensors:
        """What a client's report carries into the average, given the shared parts it uploaded."""
        return uploaded

    def server_params(self) -> NamedTensors:
        """Client parts the server hands to the global model itself at the round's end."""
        return {}


class Share(PartsPolicy):
    """Head-Emd Share: bottom and top passed from client to client; the last client's become the round's."""

    relays = True

    def __init__(self) -> None:
        self._relay: NamedTensors | None = None

    @classmethod
    def shared(cls, bottom: list[str], top: list[str]) -> list[str]:
        return bottom + top

    def begin_round(self) -> None:
        self._relay = None

    def relayed(self) -> NamedTensors | None:
        return self._relay

    def take(self, uploaded: NamedTensors) -> NamedTensors:
        self._relay = uploaded
        return {}

    def server_params(self) -> NamedTensors:
        return dict(self._relay or {})


class Average(PartsPolicy):
    """Head-Emd Avg: bottom and top averaged over the round's clients."""

    @classmethod
    def shared(cls, bottom: list[str], top: list[str]) -> list[str]:
        return bottom + top


class AverageBottom(PartsPolicy):
    """EmdAvg: the bottom (embeddings and first blocks) averaged; each client keeps its top."""

    @classmethod
    def shared(cls, bottom: list[str], top: list[str]) -> list[str]:
        return list(bottom)


class Local(PartsPolicy):
    """Nothing of the client's leaves it; only the trunk is common."""

    @classmethod
    def shared(cls, bottom: list[str], top: list[str]) -> list[str]:
        return []


PARTS_POLICIES: dict[str, type[PartsPolicy]] = {
    "share": Share, "average": Average, "average_bottom": AverageBottom, "local": Local,
}


def split_model(model: torch.nn.Module, spec: SplitConfig) -> SplitModel:
    """The model cut where a config's ``split`` section says, once checked to compute what the unsplit model
    computes: a family the parts do not split exactly is refused here, in one line, before any training."""
    split = SplitModel(model, Cut(spec.bottom_blocks, spec.top_blocks))
    split.check_exact()
    return split


def split_parts(split: SplitModel, policy: type[PartsPolicy]) -> SplitParts:
    """Each side's trainable parameters (with an adapter, only its weights and the head: a frozen base
    never travels), the client's sorted by ``policy`` into shared and local."""
    trainable = set(trainable_names(split.model))
    bottom = [n for n in split.bottom_parameter_names() if n in trainable]
    top = [n for n in split.client_parameter_names() if n in trainable and n not in set(bottom)]  # tied: bottom
    trunk = [n for n in split.trunk_parameter_names() if n in trainable]
    shared = policy.shared(bottom, top)
    local = [n for n in bottom + top if n not in set(shared)]
    return SplitParts(bottom, top, trunk, shared, local)


def client_copy(split: SplitModel) -> SplitModel:
    """A client's own model: its bottom and top are real, every trunk parameter is an empty ``meta`` tensor,
    so the client holds no trunk weights (and could not run the trunk if it tried)."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            for p in split.trunk_parameters()}
    return SplitModel(copy.deepcopy(split.model, memo), split.cut)
