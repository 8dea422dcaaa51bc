"""Where a Flower run's clients train: each on its node, as ``run_single``'s placement.

:class:`FlowerPlacement` is what the ServerApp hands ``run_single``: one object for both kinds of run, a
FedAvg-family executor that sends each job to a node, or split learning's executor whose clients are
reached through Flower while this process serves the trunk. The run config choices it is built from
(secure aggregation, the relay, split dispatch) are read here too: they need the heavy stack, which
``fedlm.flower.run_config`` keeps out of the nodes' ClientApp.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flwr.app import Context, UserConfigValue
from flwr.serverapp import Grid
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fedlm.config import ExperimentConfig
from fedlm.errors import UserError
from fedlm.federation.codecs import Codec
from fedlm.federation.collective import LOCAL, Collective
from fedlm.federation.executor import Executor
from fedlm.flower.executor import DEFAULT_REPLY_GRACE_S, DEFAULT_REPLY_TIMEOUT_S, FlowerExecutor
from fedlm.flower.nodes import NodeDirectory
from fedlm.flower.relay import RelayStore, serve_relay
from fedlm.flower.run_config import setting, switch, truthy
from fedlm.flower.secagg import FREEZE_REFUSAL, SecAggSettings
from fedlm.flower.secagg_mod import SECURE_KEY
from fedlm.flower.secure_executor import SecureFlowerExecutor
from fedlm.flower.split_clients import FlowerSplitClients
from fedlm.flower.trunk_service import TrunkService
from fedlm.run.placement import RunClients, split_executor
from fedlm.split.trunk import TrunkBackend


@dataclass(frozen=True)
class FlowerPlacement:
    """Every client on its Flower node; the model, task, data and client store live on the nodes.

    With ``secure`` the updates reach this process only as Flower's SecAgg+ aggregate; with ``relay`` the
    parameters and updates travel over ``service`` (``fedlm.flower.relay``), not in Flower's messages. A split
    run always serves its trunk on ``service``, and ``dispatch`` sends a round's turns at once."""

    grid: Grid
    nodes: NodeDirectory
    experiment: str  # the config as YAML, sent with every job
    timeout_s: float | None = DEFAULT_REPLY_TIMEOUT_S
    grace_s: float = DEFAULT_REPLY_GRACE_S
    secure: SecAggSettings | None = None
    service: TrunkService | None = None
    relay: bool = False
    dispatch: bool = False
    collective: Collective = LOCAL  # the ServerApp is one process

    def executor(self, clients: RunClients) -> Executor:
        if clients.prep.config.split is not None:
            return split_executor(clients, remote=self.split_clients)
        if clients.policy.local_names:
            raise UserError("this protocol keeps parameters on the clients, which the server needs for "
                            "evaluation; run it in simulation, not through Flower")
        if self.secure is not None:
            if clients.prep.config.protocol.aggregator != "mean":
                raise UserError(f"protocol.aggregator {clients.prep.config.protocol.aggregator} needs each client's "
                                "update, and secure aggregation shows the server only their sum: use aggregator "
                                "mean, or set secure-aggregation=false")
            sizes = {cid: len(rows) for cid, rows in clients.prep.client_train.items()}
            return SecureFlowerExecutor(self.grid, self.nodes, clients.codec, self.experiment, self.secure, sizes,
                                        timeout_s=self.timeout_s, observer=clients.observer, grace_s=self.grace_s)
        if not self.relay:
            return FlowerExecutor(self.grid, self.nodes, clients.codec, self.experiment, self.timeout_s,
                                  clients.observer, grace_s=self.grace_s)
        service = self._service()
        blobs = RelayStore(service.tokens)
        server = serve_relay(blobs, service.listen, (service.cert, service.key), service.client_ca)
        return FlowerExecutor(self.grid, self.nodes, clients.codec, self.experiment, self.timeout_s,
                              clients.observer, extra=service.extra(server.port), grace_s=self.grace_s,
                              relay=blobs, owned_server=server)

    def split_clients(self, backend: TrunkBackend, codec: Codec) -> FlowerSplitClients:
        """The split executor's ``remote``: its clients on the nodes, its trunk served here."""
        return FlowerSplitClients(backend, codec, self.grid, self.nodes, self.experiment, self.timeout_s,
                                  self._service(), self.grace_s, relay=self.relay, dispatch=self.dispatch)

    def _service(self) -> TrunkService:
        if self.service is None:
            raise ValueError("a split run and the parameter relay need the ServerApp's TrunkService")
        return self.service


def secure_settings(context: Context, defaults: Mapping[str, UserConfigValue],
                    config: ExperimentConfig) -> SecAggSettings | None:
    """SecAgg+'s settings when the run config turns ``secure-aggregation`` on (None: updates in the clear)."""
    if not truthy(setting(context, SECURE_KEY, defaults, False)):
        return None
    if config.split is not None:
        raise UserError("secure-aggregation is for the FedAvg family: a split run's trunk sees boundary "
                        "activations, which summing parameters does not hide; set secure-aggregation=false")
    if config.sharing.freeze_window is not None:
        raise UserError(FREEZE_REFUSAL)
    if config.privacy.kind == "client":
        raise UserError("privacy.kind: client clips each client's update on the server, which under "
                        "secure-aggregation sees only their sum: use privacy.kind: sample (clipping and noise on "
                        "the clients) or set secure-aggregation=false")
    return SecAggSettings.from_settings(lambda key, default: setting(context, key, defaults, default))


def relay_wanted(context: Context, defaults: Mapping[str, UserConfigValue], config: ExperimentConfig,
                 secure: SecAggSettings | None) -> bool:
    """Whether parameters travel over fedlm's relay (run config ``relay``: ``auto``, the default, uses it
    wherever the ``trunk-*`` TLS files are set and secure aggregation is off; ``true`` demands it)."""
    wanted = switch(context, "relay", defaults)
    if wanted is None:
        return secure is None and (config.split is not None or setting(context, "trunk-cert", defaults) is not None)
    if wanted and secure is not None:
        raise UserError("relay=true sends each update to the ServerApp in the clear, which secure aggregation "
                        "exists to prevent: set relay=false (or auto) with secure-aggregation")
    return wanted


def dispatch_wanted(context: Context, defaults: Mapping[str, UserConfigValue], grid: Grid) -> bool:
    """Whether a split round's turns go out at once (run config ``split-dispatch``: ``auto``, the default, does
    so in a deployment and not in Flower's in-process simulation, where nodes share the simulation's
    workers and a node waiting for its turn could hold the only one)."""
    wanted = switch(context, "split-dispatch", defaults)
    return not isinstance(grid, InMemoryGrid) if wanted is None else wanted
