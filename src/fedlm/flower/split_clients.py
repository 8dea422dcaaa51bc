"""Split learning across machines: the clients on Flower nodes, the trunk served from the ServerApp.

:class:`FlowerSplitClients` is the split executor's ``RemoteClients`` (``fedlm.split.turns``): each client
turn is a Flower message to the client's node, whose ClientApp trains the client's parts against this
process's trunk over gRPC + TLS and replies with them.
"""

from __future__ import annotations

from flwr.serverapp import Grid

from fedlm.federation.codecs import Codec
from fedlm.federation.executor import ClientJob, Result
from fedlm.flower.executor import DEFAULT_REPLY_GRACE_S, FlowerExecutor
from fedlm.flower.messages import TURN_WAIT
from fedlm.flower.nodes import NodeDirectory
from fedlm.flower.relay import RelayStore
from fedlm.flower.trunk_service import TrunkService
from fedlm.split.grpc_server import serve_trunk
from fedlm.split.trunk import TrunkBackend
from fedlm.split.turn_gate import TurnGate, TurnHook, no_turn_hook


class FlowerSplitClients:
    """This process serves the trunk over gRPC + TLS, and each client turn is one Flower message to the
    client's node (with ``relay``, the client parts travel over the trunk's server beside the messages).

    With ``dispatch``, a round whose turns do not depend on each other (client parts averaged, no client
    deadline) goes out as one message per client at once, and the trunk's turn gate runs the turns in job
    order (:mod:`fedlm.split.turn_gate`): Flower's per-message latency is paid once a round, not once a turn.
    It needs every node in its own process (a deployment): in Flower's in-process simulation a node waiting
    for its turn would hold the only worker."""

    def __init__(self, backend: TrunkBackend, codec: Codec, grid: Grid, nodes: NodeDirectory, experiment: str,
                 timeout_s: float | None, service: TrunkService, grace_s: float = DEFAULT_REPLY_GRACE_S,
                 relay: bool = True, dispatch: bool = False) -> None:
        blobs = RelayStore(service.tokens) if relay else None
        self.gate = TurnGate()
        self.dispatch_rounds = dispatch
        self.server = serve_trunk(backend, service.listen, tokens=service.tokens, tls=(service.cert, service.key),
                                  client_ca_pem=service.client_ca, max_sessions=max(16, nodes.num_clients + 4),
                                  extra_services=[blobs.handler()] if blobs is not None else [], gate=self.gate)
        extra = {**service.extra(self.server.port), **({TURN_WAIT: timeout_s} if timeout_s else {})}
        self.flower = FlowerExecutor(grid, nodes, codec, experiment, timeout_s, extra=extra, grace_s=grace_s,
                                     relay=blobs)

    def run(self, jobs: list[ClientJob]) -> list[Result]:
        """Turns sent one by one (a round of one each): only that client may reach the trunk meanwhile."""
        return self.dispatch(jobs, no_turn_hook, no_turn_hook)

    def dispatches(self, jobs: list[ClientJob]) -> bool:
        """Whether ``jobs`` go out at once: asked for, and no client deadline (a node's deadline counts from
        the message's arrival, so waiting for its turn would use it up)."""
        return self.dispatch_rounds and len(jobs) > 1 and all(job.timeout_s is None for job in jobs)

    def dispatch(self, jobs: list[ClientJob], on_start: TurnHook, on_end: TurnHook) -> list[Result]:
        self.gate.open([str(job.client_id) for job in jobs], on_start, on_end)
        try:  # a reply ends its client's turn if its session did not (it failed before its turn, or never came)
            return self.flower.run(jobs, on_reply=lambda client_id: self.gate.end(str(client_id)))
        finally:
            self.gate.close()

    def close(self) -> None:
        self.server.stop(grace=1.0)
