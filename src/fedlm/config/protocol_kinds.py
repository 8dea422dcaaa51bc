"""What each ``protocol.kind`` means beyond its strategy, written once: whether it pools the data on one client,
whether anything is shared, whether a server averages updates (and so whether bytes are counted, clients are
sampled and client-level DP has something to noise). Every rule elsewhere asks these properties, never the name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProtocolKind:
    name: str
    pools_data: bool = False  # one client holds every training example (centralized training)
    shares_nothing: bool = False  # each client trains alone and sends nothing (isolated training, c = 0)

    @property
    def averages_updates(self) -> bool:
        """A server aggregates the sampled clients' updates (the FedAvg family)."""
        return not (self.pools_data or self.shares_nothing)

    @property
    def counts_bytes(self) -> bool:
        """Something crosses a client-server boundary, so bytes are counted."""
        return self.averages_updates

    @property
    def samples_clients(self) -> bool:
        """``clients_per_round`` / ``fraction`` apply; otherwise every client trains every round."""
        return self.averages_updates

    @property
    def has_wire(self) -> bool:
        """Parameters are encoded by ``protocol.codec`` (pooled training keeps full precision: nothing is sent)."""
        return not self.pools_data

    @property
    def evaluates_clients(self) -> bool:
        """Scores on each client's own test split mean something (pooled training has one client)."""
        return not self.pools_data


PROTOCOL_KINDS: dict[str, ProtocolKind] = {
    "centralized": ProtocolKind("centralized", pools_data=True),
    "isolated": ProtocolKind("isolated", shares_nothing=True),
    "fedavg": ProtocolKind("fedavg"),
    "fedprox": ProtocolKind("fedprox"),
    "fedopt": ProtocolKind("fedopt"),
}
