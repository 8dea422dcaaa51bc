"""fedlm's Flower ServerApp: the simulator's round engine, with each sampled client's job sent to a node.

There is no second round loop: the ServerApp calls ``run_single`` with a ``FlowerExecutor`` (and, for split
learning, ``FlowerSplitClients``, which also serves the trunk), so sampling, aggregation, evaluation,
records, checkpoints and the run directory are the simulator's. How to deploy: ``deploy/flower/README.md``.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from flwr.app import ConfigRecordValues, Context, Message, MessageType, RecordDict, UserConfigValue
from flwr.serverapp import Grid, ServerApp

from fedlm.config import dump_config, read_yaml, validate
from fedlm.errors import UserError
from fedlm.federation.client_round import NonFiniteUpdate, client_failure, refuse_non_finite
from fedlm.federation.codecs import Codec
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.params import NamedTensors
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import ClientUpdate
from fedlm.flower.messages import PARTITION_KEY, TRUNK_ADDRESS, TRUNK_CA, encoded_from_records, job_content
from fedlm.run.prepare import num_clients_of
from fedlm.run.recorder import slug
from fedlm.run.single import ExecutorFactory, run_single
from fedlm.split.grpc import load_tokens, serve_trunk
from fedlm.split.trunk import TrunkBackend
from fedlm.tasks import Task

log = logging.getLogger("fedlm")

DEFAULT_NODE_WAIT_S = 300.0
DEFAULT_REPLY_TIMEOUT_S = 3600.0


def discover_clients(grid: Grid, num_clients: int, wait_s: float, poll_s: float = 0.5) -> dict[int, int]:
    """Map fedlm client id -> Flower node id by asking each node its partition-id (the Grid does not show
    node configs).

    Waits up to ``wait_s`` for all ``num_clients`` to show up (SuperNodes may connect after the run starts);
    clients still missing then are reported as failed whenever they are sampled.
    """
    found: dict[int, int] = {}
    asked: set[int] = set()
    deadline = time.monotonic() + wait_s
    while len(found) < num_clients and time.monotonic() < deadline:
        new = [node for node in grid.get_node_ids() if node not in asked]
        asked.update(new)
        if not new:
            time.sleep(poll_s)
            continue
        queries = [Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY) for node in new]
        for reply in grid.send_and_receive(queries, timeout=max(deadline - time.monotonic(), poll_s)):
            _register_node(found, reply, num_clients)
    missing = sorted(set(range(num_clients)) - set(found))
    if len(missing) == num_clients:
        raise UserError(f"no Flower node answered as a fedlm client within {wait_s:.0f}s; start SuperNodes "
                        f"with --node-config 'partition-id=<0..{num_clients - 1}>'")
    if missing:
        log.warning("no Flower node serves clients %s; they fail whenever sampled", missing)
    return found


def _register_node(found: dict[int, int], reply: Message, num_clients: int) -> None:
    node = reply.metadata.src_node_id
    if reply.has_error():
        log.warning("node %d did not say which client it is: %s", node, reply.error.reason)
        return
    client_id = int(reply.content["node"][PARTITION_KEY])
    if not 0 <= client_id < num_clients:
        log.warning("node %d is partition %d, outside 0..%d; not used", node, client_id, num_clients - 1)
        return
    if client_id in found:
        raise UserError(f"nodes {found[client_id]} and {node} both claim partition-id {client_id}")
    found[client_id] = node


class FlowerExecutor:
    """The engine's ``Executor`` over Flower: each job to its client's node in one ``send_and_receive``,
    results in job order.

    Job order (not arrival order) keeps the aggregation's summation order, hence the result, identical to
    the in-process simulator's.
    """

    def __init__(self, grid: Grid, node_ids_by_client: dict[int, int], codec: Codec, experiment: str,
                 timeout_s: float | None = DEFAULT_REPLY_TIMEOUT_S, progress: Callable[[int], None] | None = None,
                 extra: Mapping[str, ConfigRecordValues] | None = None) -> None:
        self.grid = grid
        self.nodes = node_ids_by_client
        self.codec = codec
        self.experiment = experiment
        self.timeout_s = timeout_s
        self.progress = progress
        self.extra = extra

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        results: dict[int, ClientReport | ClientFailure] = {
            job.client_id: ClientFailure(job.client_id, f"no Flower node serves client {job.client_id}")
            for job in jobs if job.client_id not in self.nodes}
        by_node = {self.nodes[job.client_id]: job for job in jobs if job.client_id in self.nodes}
        messages = [Message(job_content(job, self.experiment, self.codec.block_size, self.extra), dst_node_id=node,
                            message_type=MessageType.TRAIN, ttl=self.timeout_s, group_id=str(job.round_idx))
                    for node, job in by_node.items()]
        replies = self.grid.send_and_receive(messages, timeout=self.timeout_s) if messages else []
        for reply in replies:
            job = by_node.get(reply.metadata.src_node_id)
            if job is not None:
                results[job.client_id] = self._read_reply(job, reply)
        for job in jobs:
            results.setdefault(job.client_id, ClientFailure(job.client_id, self._no_reply()))
            if self.progress is not None:
                self.progress(job.client_id)
        return [results[job.client_id] for job in jobs]

    def close(self) -> None:
        """Nothing to release: the nodes outlive the run."""

    def _no_reply(self) -> str:
        return f"timeout: no reply within {self.timeout_s:.0f}s" if self.timeout_s else "no reply"

    def _read_reply(self, job: ClientJob, reply: Message) -> ClientReport | ClientFailure:
        if reply.has_error():
            return ClientFailure(job.client_id, reply.error.reason or f"Flower error {reply.error.code}")
        try:
            return self._report(job, reply.content)
        except NonFiniteUpdate as exc:
            return client_failure(job.client_id, exc)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            return ClientFailure(job.client_id, f"malformed reply: {type(exc).__name__}: {exc}")

    def _report(self, job: ClientJob, content: RecordDict) -> ClientReport:
        """A reply as the engine's report; the node's word is checked, not trusted (shapes, finiteness)."""
        if int(content["config"]["client-id"]) != job.client_id:
            raise ValueError(f"reply is from client {content['config']['client-id']}, not {job.client_id}")
        arrays, meta = content["arrays"], content["meta"]
        received = encoded_from_records(arrays, meta, self.codec.name)
        skip = set(job.frozen)  # frozen this round: trained by nobody here, so not sent back
        _check_like(received.tensors, {n: t for n, t in job.params.tensors.items() if n not in skip}, "parameter")
        _check_like(received.meta, {n: t for n, t in job.params.meta.items() if n not in skip}, "metadata")
        params = self.codec.decode(received)
        refuse_non_finite(params)
        metrics = content["metrics"]
        extra = {k: float(v) for k, v in metrics.items() if k != "num-examples"}
        in_sent_order = {n: params[n] for n in job.params.tensors if n not in skip}
        update = ClientUpdate(job.client_id, int(metrics["num-examples"]), in_sent_order, extra)
        meta_bytes = meta.count_bytes()
        return ClientReport(update, arrays.count_bytes() + meta_bytes, upload_meta_bytes=meta_bytes)


def _check_like(received: NamedTensors, sent: NamedTensors, what: str) -> None:
    """An update is encoded like the parameters it answers: same names, shapes and dtypes."""
    if set(received) != set(sent):
        raise ValueError(f"{what} names differ from those sent ({len(received)} vs {len(sent)})")
    for name, value in received.items():
        if value.shape != sent[name].shape or value.dtype != sent[name].dtype:
            raise ValueError(f"{name}: got {value.dtype}{tuple(value.shape)}, "
                             f"expected {sent[name].dtype}{tuple(sent[name].shape)}")


def flower_executor_factory(grid: Grid, node_ids_by_client: dict[int, int], experiment: str,
                            timeout_s: float | None) -> ExecutorFactory:
    """``run_single``'s ``executor_factory``: the model, task, data and client store live on the nodes."""

    def factory(model: torch.nn.Module, task: Task, client_rows: dict[int, Sequence[dict]], codec: Codec,
                store: ClientStore, local_names: list[str],
                progress: Callable[[int], None] | None = None) -> FlowerExecutor:
        del model, task, client_rows, store
        if local_names:
            raise UserError("this protocol keeps parameters on the clients, which the server needs for "
                            "evaluation; run it in simulation, not through Flower")
        return FlowerExecutor(grid, node_ids_by_client, codec, experiment, timeout_s, progress)

    return factory


@dataclass(frozen=True)
class TrunkService:
    """How the ServerApp serves a split run's trunk (run config keys ``trunk-*``): TLS is required, every
    client needs its token, and ``client_ca`` (optional) demands client certificates too."""

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
                    raise UserError(f"a split run through Flower serves its trunk over TLS: set the run config "
                                    f"key '{key}' (a PEM file)")
                return None
            path = Path(str(value))
            if not path.is_file():
                raise UserError(f"run config {key}: file not found: {path}")
            return path.read_bytes()

        tokens = _setting(context, "trunk-tokens", defaults)
        if tokens is None:
            raise UserError("a split run through Flower needs client tokens: set the run config key "
                            "'trunk-tokens' (a YAML file of client id -> token)")
        cert, key = read("trunk-cert"), read("trunk-key")
        address = _setting(context, "trunk-address", defaults)
        return cls(str(_setting(context, "trunk-listen", defaults, "[::]:9100")),
                   None if address is None else str(address), cert, key, read("trunk-ca", False) or cert,
                   load_tokens(str(tokens)), read("trunk-client-ca", False))


class FlowerSplitClients:
    """Split learning across machines, as ``RemoteClients``: this process serves the trunk over gRPC + TLS,
    and each client turn is one Flower message to the client's node, whose ClientApp trains the client's
    parts against that trunk and replies with them."""

    def __init__(self, backend: TrunkBackend, codec: Codec, grid: Grid, nodes: dict[int, int], experiment: str,
                 timeout_s: float | None, service: TrunkService) -> None:
        self.server = serve_trunk(backend, service.listen, tokens=service.tokens, tls=(service.cert, service.key),
                                  client_ca_pem=service.client_ca, max_sessions=max(16, len(nodes) + 4))
        host = service.listen.rsplit(":", 1)[0]
        local = host if host in ("localhost", "127.0.0.1", "[::1]") else socket.getfqdn()
        address = service.address or f"{local}:{self.server.port}"
        extra = {TRUNK_ADDRESS: address, TRUNK_CA: service.ca.decode()}
        self.flower = FlowerExecutor(grid, nodes, codec, experiment, timeout_s, extra=extra)

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        return self.flower.run(jobs)

    def close(self) -> None:
        self.server.stop(grace=1.0)


def _setting(context: Context, key: str, defaults: Mapping[str, UserConfigValue],
             fallback: UserConfigValue | None = None) -> UserConfigValue | None:
    """Run config (non-empty) first, then the app's defaults, then ``fallback``."""
    value = context.run_config.get(key)
    if value in (None, ""):
        value = defaults.get(key)
    return fallback if value in (None, "") else value


def build_server_app(**defaults: UserConfigValue) -> ServerApp:
    """The ServerApp; ``defaults`` (config, data-dir, run-dir, ...) fill run config keys left empty."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        path = _setting(context, "config", defaults)
        if path is None:
            raise UserError("no experiment config: set the run config key 'config' to a YAML path")
        config = validate(read_yaml(Path(str(path))))
        run_dir = _setting(context, "run-dir", defaults, str(Path(config.output_dir) / slug(config.name)))
        wait_s = float(_setting(context, "node-wait-s", defaults, DEFAULT_NODE_WAIT_S))
        timeout_s = float(_setting(context, "reply-timeout-s", defaults, DEFAULT_REPLY_TIMEOUT_S))
        nodes = discover_clients(grid, num_clients_of(config), wait_s)
        experiment = dump_config(config)
        factory = flower_executor_factory(grid, nodes, experiment, timeout_s)
        split_remote = None
        if config.split is not None:
            service = TrunkService.from_settings(context, defaults)
            split_remote = partial(FlowerSplitClients, grid=grid, nodes=nodes, experiment=experiment,
                                   timeout_s=timeout_s, service=service)
        run_single(config, Path(str(_setting(context, "data-dir", defaults, "."))), Path(str(run_dir)),
                   executor_factory=factory, split_remote=split_remote)

    return app


server_app = build_server_app()
