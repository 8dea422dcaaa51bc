"""fedlm's Flower ServerApp: the simulator's round engine, with each sampled client's job sent to a node.

There is no second round loop: the ServerApp calls ``run_single`` with a ``FlowerExecutor`` (and, for split
learning, ``FlowerSplitClients``, which also serves the trunk), so sampling, aggregation, evaluation,
records, checkpoints and the run directory are the simulator's. How to deploy: ``deploy/flower/README.md``.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecordValues, Context, Message, MessageType, RecordDict, UserConfigValue
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fedlm.config import ExperimentConfig, dump_config, read_yaml, validate
from fedlm.errors import UserError
from fedlm.federation.client_round import NonFiniteUpdate, client_failure, refuse_non_finite
from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.params import NamedTensors
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import ClientUpdate
from fedlm.flower.messages import (
    TRUNK_ADDRESS,
    TRUNK_CA,
    TURN_WAIT,
    encoded_from_blob,
    encoded_from_records,
    is_relayed,
    job_content,
)
from fedlm.flower.nodes import NodeDirectory, PromptGrid, match_replies
from fedlm.flower.relay import DIGEST_KEY, RelayStore, serve_relay, to_blob
from fedlm.flower.secagg import FREEZE_REFUSAL, SecAggSettings, SecureAggregation
from fedlm.flower.secagg_mod import SECURE_KEY, truthy
from fedlm.run.prepare import num_clients_of
from fedlm.run.recorder import slug
from fedlm.run.single import ExecutorFactory, run_single
from fedlm.split.grpc import TrunkServer, load_tokens, serve_trunk
from fedlm.split.trunk import TrunkBackend
from fedlm.split.turn_gate import TurnGate, TurnHook, no_turn_hook
from fedlm.tasks import Task

log = logging.getLogger("fedlm")

DEFAULT_NODE_WAIT_S = 300.0
DEFAULT_REPLY_TIMEOUT_S = 3600.0
DEFAULT_REPLY_GRACE_S = 120.0  # beyond client_timeout_s: a node's data preparation and the transfers
ERROR_NAMES = {value: name for name, value in vars(ErrorCode).items() if isinstance(value, int)}


class FlowerExecutor:
    """The engine's ``Executor`` over Flower: each job to its client's node in one ``send_and_receive``,
    results in job order.

    Job order (not arrival order) keeps the aggregation's summation order, hence the result, identical to
    the in-process simulator's.
    """

    def __init__(self, grid: Grid, nodes: NodeDirectory | dict[int, int], codec: Codec, experiment: str,
                 timeout_s: float | None = DEFAULT_REPLY_TIMEOUT_S, progress: Callable[[int], None] | None = None,
                 extra: Mapping[str, ConfigRecordValues] | None = None,
                 grace_s: float = DEFAULT_REPLY_GRACE_S, relay: RelayStore | None = None,
                 owned_server: TrunkServer | None = None) -> None:
        self.grid = grid
        self.nodes = nodes if isinstance(nodes, NodeDirectory) else NodeDirectory.fixed(grid, nodes)
        self.codec = codec
        self.experiment = experiment
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.progress = progress
        self.extra = extra
        self.relay = relay  # parameters and updates beside the messages (``fedlm.flower.relay``)
        self.owned_server = owned_server  # the relay's own server, stopped with the executor

    def run(self, jobs: list[ClientJob],
            on_reply: Callable[[int], None] | None = None) -> list[ClientReport | ClientFailure]:
        """Each job's result in job order; ``on_reply`` (with a ``PromptGrid``) hears each client id as its
        reply arrives, or at once for a client no node serves."""
        results, routed = self._route(jobs)
        for client_id in results if on_reply is not None else ():
            on_reply(client_id)
        results.update(self._exchange(routed, self.wait_s(jobs), on_reply))
        for job in jobs:
            if self.progress is not None:
                self.progress(job.client_id)
        return [results[job.client_id] for job in jobs]

    def _route(self, jobs: list[ClientJob]) -> tuple[dict[int, ClientReport | ClientFailure],
                                                     list[tuple[ClientJob, int]]]:
        """Each job paired with its client's node; a client without one fails at once."""
        self.nodes.refresh()  # a SuperNode restarted since the last round takes part again
        results: dict[int, ClientReport | ClientFailure] = {}
        routed: list[tuple[ClientJob, int]] = []
        for job in jobs:
            node = self.nodes.node_of(job.client_id)
            if node is None:
                results[job.client_id] = ClientFailure(job.client_id, f"no Flower node serves client {job.client_id}")
            else:
                routed.append((job, node))
        return results, routed

    def _exchange(self, routed: list[tuple[ClientJob, int]], wait: float | None,
                  on_reply: Callable[[int], None] | None = None) -> dict[int, ClientReport | ClientFailure]:
        """One train message per routed job, each client's update read back in the clear."""
        try:
            digests: dict[int, str | None] = {}  # jobs sharing one parameter set share its blob on the relay
            for job, _ in routed:
                if id(job.params) not in digests:
                    digests[id(job.params)] = self._offer(job.params)
            messages = [Message(job_content(job, self.experiment, self.codec.block_size, self.extra,
                                            digests[id(job.params)]),
                                dst_node_id=node, message_type=MessageType.TRAIN, ttl=wait, group_id=str(job.round_idx))
                        for job, node in routed]
            heard = {}
            if on_reply is not None:  # only PromptGrid takes it: the deployment's ServerApp always has one
                def arrived(reply: Message) -> None:
                    for index in match_replies(messages, [reply]):
                        on_reply(routed[index][0].client_id)

                heard = {"on_reply": arrived}
            replies = match_replies(messages, self.grid.send_and_receive(messages, timeout=wait, **heard)) \
                if messages else {}
            results: dict[int, ClientReport | ClientFailure] = {}
            for index, (job, node) in enumerate(routed):
                reply = replies.get(index)
                results[job.client_id] = (ClientFailure(job.client_id, self._no_reply(wait)) if reply is None
                                          else self._read_reply(job, node, reply))
            return results
        finally:
            if self.relay is not None:
                self.relay.clear()  # the round's parameters and updates, taken or not

    def _offer(self, params: Encoded) -> str | None:
        """The digest of ``params`` put on the relay (None: no relay, they travel in the message)."""
        return None if self.relay is None else self.relay.offer(to_blob(params.tensors, params.meta))

    def wait_s(self, jobs: list[ClientJob]) -> float | None:
        """How long the round waits for replies: the reply timeout, cut to the clients' own deadline
        (``client_timeout_s``) plus ``grace_s`` for preparation and transfer when every job has one. A node
        abandons a job at its deadline and answers with a timeout; one that cannot answer is cut off here."""
        limits = [job.timeout_s for job in jobs]
        if not jobs or not all(limits):
            return self.timeout_s
        own = max(limit for limit in limits if limit) + self.grace_s
        return own if self.timeout_s is None else min(self.timeout_s, own)

    def close(self) -> None:
        """Stop the relay's own server, if any (the nodes outlive the run)."""
        if self.owned_server is not None:
            self.owned_server.stop(grace=1.0)

    @staticmethod
    def _no_reply(wait: float | None) -> str:
        return f"timeout: no reply within {wait:.0f}s" if wait else "no reply"

    def _read_reply(self, job: ClientJob, node: int, reply: Message) -> ClientReport | ClientFailure:
        if reply.has_error():
            return ClientFailure(job.client_id, self._error_reason(node, reply.error.code, reply.error.reason))
        try:
            return self._report(job, reply.content)
        except NonFiniteUpdate as exc:
            return client_failure(job.client_id, exc)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            return ClientFailure(job.client_id, f"malformed reply: {type(exc).__name__}: {exc}")

    def _error_reason(self, node: int, code: int, reason: str) -> str:
        """An error reply as the run records it. The client's own errors already read as fedlm's reasons
        (``timeout: ...``, ``exception: ...``); the SuperLink's are named by what happened to the node."""
        if code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and reason:
            return reason
        if code == ErrorCode.NODE_UNAVAILABLE:
            self.nodes.forget(node, "is unavailable")
            return f"node unavailable: node {node} stopped sending heartbeats to the SuperLink"
        if code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE):
            return f"message expired: the job or its reply outlived its time to live ({reason})"
        return f"Flower error {ERROR_NAMES.get(code, code)}: {reason}"

    def _report(self, job: ClientJob, content: RecordDict) -> ClientReport:
        """A reply as the engine's report; the node's word is checked, not trusted (shapes, finiteness)."""
        if int(content["config"]["client-id"]) != job.client_id:
            raise ValueError(f"reply is from client {content['config']['client-id']}, not {job.client_id}")
        received, sent_bytes, meta_bytes = self._received(job, content)
        skip = set(job.frozen)  # frozen this round: trained by nobody here, so not sent back
        _check_like(received.tensors, {n: t for n, t in job.params.tensors.items() if n not in skip}, "parameter")
        _check_like(received.meta, {n: t for n, t in job.params.meta.items() if n not in skip}, "metadata")
        params = self.codec.decode(received)
        refuse_non_finite(params)
        metrics = content["metrics"]
        extra = {k: float(v) for k, v in metrics.items() if k != "num-examples"}
        in_sent_order = {n: params[n] for n in job.params.tensors if n not in skip}
        update = ClientUpdate(job.client_id, int(metrics["num-examples"]), in_sent_order, extra)
        return ClientReport(update, sent_bytes, upload_meta_bytes=meta_bytes)

    def _received(self, job: ClientJob, content: RecordDict) -> tuple[Encoded, int, int]:
        """The update as the codec encoded it, and the bytes it took (all, and those of its metadata): the
        relay's blob (safetensors' header included), or the message's arrays (with Flower's framing)."""
        if is_relayed(content):
            if self.relay is None:
                raise ValueError("the reply points at a relay this run does not serve")
            blob = self.relay.take_upload(job.client_id, str(content["config"][DIGEST_KEY]))
            received = encoded_from_blob(blob, self.codec.name)
            return received, len(blob), received.meta_bytes
        arrays, meta = content["arrays"], content["meta"]
        meta_bytes = meta.count_bytes()
        return encoded_from_records(arrays, meta, self.codec.name), arrays.count_bytes() + meta_bytes, meta_bytes


class SecureFlowerExecutor(FlowerExecutor):
    """The Flower executor with Flower's SecAgg+ between the nodes and this process: every surviving client's
    report holds the round's secure aggregate, never its own update (``fedlm.flower.secagg``)."""

    def __init__(self, grid: Grid, nodes: NodeDirectory | dict[int, int], codec: Codec, experiment: str,
                 settings: SecAggSettings, client_sizes: Mapping[int, int], **kwargs: Any) -> None:
        super().__init__(grid, nodes, codec, experiment, **kwargs)
        self.secure = SecureAggregation(grid, settings, client_sizes, self._error_reason)

    def _exchange(self, routed: list[tuple[ClientJob, int]], wait: float | None,
                  on_reply: Callable[[int], None] | None = None) -> dict[int, ClientReport | ClientFailure]:
        if on_reply is not None:  # only split rounds listen for replies, and they refuse secure aggregation
            raise ValueError("secure aggregation's four exchanges have no per-reply hook")
        if any(job.frozen for job, _ in routed):
            raise UserError(FREEZE_REFUSAL)
        return self.secure.run(routed, self.codec, self.experiment, self.extra, wait)


def _check_like(received: NamedTensors, sent: NamedTensors, what: str) -> None:
    """An update is encoded like the parameters it answers: same names, shapes and dtypes."""
    if set(received) != set(sent):
        raise ValueError(f"{what} names differ from those sent ({len(received)} vs {len(sent)})")
    for name, value in received.items():
        if value.shape != sent[name].shape or value.dtype != sent[name].dtype:
            raise ValueError(f"{name}: got {value.dtype}{tuple(value.shape)}, "
                             f"expected {sent[name].dtype}{tuple(sent[name].shape)}")


def flower_executor_factory(grid: Grid, nodes: NodeDirectory, experiment: str, timeout_s: float | None,
                            grace_s: float = DEFAULT_REPLY_GRACE_S, secure: SecAggSettings | None = None,
                            relay: TrunkService | None = None) -> ExecutorFactory:
    """``run_single``'s ``executor_factory``: the model, task, data and client store live on the nodes;
    with ``secure`` the updates reach this process only as Flower's SecAgg+ aggregate; with ``relay`` the
    parameters and updates travel over that service (``fedlm.flower.relay``), not in Flower's messages."""

    def factory(model: torch.nn.Module, task: Task, client_rows: dict[int, Sequence[dict]], codec: Codec,
                store: ClientStore, local_names: list[str],
                progress: Callable[[int], None] | None = None) -> FlowerExecutor:
        del model, task, store
        if local_names:
            raise UserError("this protocol keeps parameters on the clients, which the server needs for "
                            "evaluation; run it in simulation, not through Flower")
        if secure is not None:
            sizes = {cid: len(rows) for cid, rows in client_rows.items()}
            return SecureFlowerExecutor(grid, nodes, codec, experiment, secure, sizes, timeout_s=timeout_s,
                                        progress=progress, grace_s=grace_s)
        if relay is None:
            return FlowerExecutor(grid, nodes, codec, experiment, timeout_s, progress, grace_s=grace_s)
        blobs = RelayStore(relay.tokens)
        server = serve_relay(blobs, relay.listen, (relay.cert, relay.key), relay.client_ca)
        return FlowerExecutor(grid, nodes, codec, experiment, timeout_s, progress, extra=relay.extra(server.port),
                              grace_s=grace_s, relay=blobs, owned_server=server)

    return factory


@dataclass(frozen=True)
class TrunkService:
    """How the ServerApp serves its own gRPC service, a split run's trunk and the parameter relay (run config
    keys ``trunk-*``): TLS is required, every client needs its token, and ``client_ca`` (optional) demands
    client certificates too."""

    listen: str
    address: str | None  # what nodes dial; None: this machine's name and the port it got
    cert: bytes
    key: bytes
    ca: bytes  # sent to the nodes so they can verify ``cert``
    tokens: dict[str, str]
    client_ca: bytes | None = None

    @classmethod
    def from_settings(cls, context: Context, defaults: Mapping[str, UserConfigValue]) -> TrunkService:
        def read(key: str, required: bool = True) -> bytes | None:
            value = _setting(context, key, defaults)
            if value is None:
                if required:
                    raise UserError(f"the ServerApp serves its trunk / parameter relay over TLS: set the run "
                                    f"config key '{key}' (a PEM file), or relay=false for a FedAvg-family run")
                return None
            path = Path(str(value))
            if not path.is_file():
                raise UserError(f"run config {key}: file not found: {path}")
            return path.read_bytes()

        tokens = _setting(context, "trunk-tokens", defaults)
        if tokens is None:
            raise UserError("the ServerApp's trunk / parameter relay needs client tokens: set the run config key "
                            "'trunk-tokens' (a YAML file of client id -> token)")
        cert, key = read("trunk-cert"), read("trunk-key")
        address = _setting(context, "trunk-address", defaults)
        return cls(str(_setting(context, "trunk-listen", defaults, "[::]:9100")),
                   None if address is None else str(address), cert, key, read("trunk-ca", False) or cert,
                   load_tokens(str(tokens)), read("trunk-client-ca", False))

    def extra(self, port: int) -> dict[str, ConfigRecordValues]:
        """What each job tells its node about the service: the address to dial (``address``, else this
        machine's name, or the loopback name it listens on, and the bound ``port``) and the CA's PEM."""
        host = self.listen.rsplit(":", 1)[0]
        local = host if host in ("localhost", "127.0.0.1", "[::1]") else socket.getfqdn()
        return {TRUNK_ADDRESS: self.address or f"{local}:{port}", TRUNK_CA: self.ca.decode()}


class FlowerSplitClients:
    """Split learning across machines, as ``RemoteClients``: this process serves the trunk over gRPC + TLS,
    and each client turn is one Flower message to the client's node, whose ClientApp trains the client's
    parts against that trunk and replies with them (with ``relay``, the parts travel over the trunk's server
    beside the messages).

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

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        """Turns sent one by one (a round of one each): only that client may reach the trunk meanwhile."""
        return self.dispatch(jobs, no_turn_hook, no_turn_hook)

    def dispatches(self, jobs: list[ClientJob]) -> bool:
        """Whether ``jobs`` go out at once: asked for, and no client deadline (a node's deadline counts from
        the message's arrival, so waiting for its turn would use it up)."""
        return self.dispatch_rounds and len(jobs) > 1 and all(job.timeout_s is None for job in jobs)

    def dispatch(self, jobs: list[ClientJob], on_start: TurnHook,
                 on_end: TurnHook) -> list[ClientReport | ClientFailure]:
        self.gate.open([str(job.client_id) for job in jobs], on_start, on_end)
        try:  # a reply ends its client's turn if its session did not (it failed before its turn, or never came)
            return self.flower.run(jobs, on_reply=lambda client_id: self.gate.end(str(client_id)))
        finally:
            self.gate.close()

    def close(self) -> None:
        self.server.stop(grace=1.0)


def _setting(context: Context, key: str, defaults: Mapping[str, UserConfigValue],
             fallback: UserConfigValue | None = None) -> UserConfigValue | None:
    """Run config (non-empty) first, then the app's defaults, then ``fallback``."""
    value = context.run_config.get(key)
    if value in (None, ""):
        value = defaults.get(key)
    return fallback if value in (None, "") else value


def secure_settings(context: Context, defaults: Mapping[str, UserConfigValue],
                    config: ExperimentConfig) -> SecAggSettings | None:
    """SecAgg+'s settings when the run config turns ``secure-aggregation`` on (None: updates in the clear)."""
    if not truthy(_setting(context, SECURE_KEY, defaults, False)):
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
    return SecAggSettings.from_settings(lambda key, default: _setting(context, key, defaults, default))


def relay_wanted(context: Context, defaults: Mapping[str, UserConfigValue], config: ExperimentConfig,
                 secure: SecAggSettings | None) -> bool:
    """Whether parameters travel over fedlm's relay (run config ``relay``: ``auto``, the default, uses it
    wherever the ``trunk-*`` TLS files are set and secure aggregation is off; ``true`` demands it)."""
    value = str(_setting(context, "relay", defaults, "auto")).strip().lower()
    if value not in ("auto", "true", "false", "1", "0", "yes", "no"):
        raise UserError(f"run config relay={value!r}: use auto, true or false")
    if value == "auto":
        return secure is None and (config.split is not None or _setting(context, "trunk-cert", defaults) is not None)
    if truthy(value) and secure is not None:
        raise UserError("relay=true sends each update to the ServerApp in the clear, which secure aggregation "
                        "exists to prevent: set relay=false (or auto) with secure-aggregation")
    return truthy(value)


def dispatch_wanted(context: Context, defaults: Mapping[str, UserConfigValue], grid: Grid) -> bool:
    """Whether a split round's turns go out at once (run config ``split-dispatch``: ``auto``, the default, does
    so in a deployment and not in Flower's in-process simulation, where nodes share the simulation's
    workers and a node waiting for its turn could hold the only one)."""
    value = str(_setting(context, "split-dispatch", defaults, "auto")).strip().lower()
    if value not in ("auto", "true", "false", "1", "0", "yes", "no"):
        raise UserError(f"run config split-dispatch={value!r}: use auto, true or false")
    return not isinstance(grid, InMemoryGrid) if value == "auto" else truthy(value)


def build_server_app(**defaults: UserConfigValue) -> ServerApp:
    """The ServerApp; ``defaults`` (config, data-dir, run-dir, ...) fill run config keys left empty."""
    app = ServerApp()

    @app.main()
    def main(flower_grid: Grid, context: Context) -> None:
        grid: Grid = PromptGrid(flower_grid)  # type: ignore[assignment]
        path = _setting(context, "config", defaults)
        if path is None:
            raise UserError("no experiment config: set the run config key 'config' to a YAML path")
        config = validate(read_yaml(Path(str(path))))
        run_dir = _setting(context, "run-dir", defaults, str(Path(config.output_dir) / slug(config.name)))
        wait_s = float(_setting(context, "node-wait-s", defaults, DEFAULT_NODE_WAIT_S))
        timeout_s = float(_setting(context, "reply-timeout-s", defaults, DEFAULT_REPLY_TIMEOUT_S))
        grace_s = float(_setting(context, "reply-grace-s", defaults, DEFAULT_REPLY_GRACE_S))
        nodes = NodeDirectory(grid, num_clients_of(config))
        nodes.discover(wait_s)
        experiment = dump_config(config)
        secure = secure_settings(context, defaults, config)
        relay = relay_wanted(context, defaults, config, secure)
        print(f"[{config.name}] parameters travel " + ("on fedlm's relay (gRPC + TLS, a token per client), beside "
                                                       "Flower's messages" if relay else "in Flower's messages"),
              flush=True)
        service = TrunkService.from_settings(context, defaults) if relay or config.split is not None else None
        factory = flower_executor_factory(grid, nodes, experiment, timeout_s, grace_s, secure,
                                          service if relay and config.split is None else None)
        split_remote = None
        if config.split is not None:
            split_remote = partial(FlowerSplitClients, grid=grid, nodes=nodes, experiment=experiment,
                                   timeout_s=timeout_s, service=service, grace_s=grace_s, relay=relay,
                                   dispatch=dispatch_wanted(context, defaults, flower_grid))
        resume = truthy(_setting(context, "resume", defaults, False))  # a killed ServerApp, run again
        run_single(config, Path(str(_setting(context, "data-dir", defaults, "."))), Path(str(run_dir)),
                   resume=resume, executor_factory=factory, split_remote=split_remote)

    return app


server_app = build_server_app()
