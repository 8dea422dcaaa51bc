"""The round engine across machines: Flower (flwr >= 1.41 message API) as one more ``Executor``.

There is no second round loop. The ``ServerApp`` calls ``experiment.run_single`` with a ``FlowerExecutor``,
so sampling, aggregation, evaluation, recording, checkpoints and the run directory are the simulator's.
Each sampled client's job becomes one Flower message; the ``ClientApp`` on the node runs ``fit_client``,
the function the in-process simulator calls, and replies with its update.

Who is client i: a SuperNode is fedlm client ``partition-id`` of its node config (the key Flower's own
simulation runtime sets). At start the server sends every node a ``query`` message and routes client i's
jobs to the node that answered ``partition-id = i`` (flwr 1.41's ``Grid`` does not expose node configs).

What travels:

* ``query`` (server -> each node, once): empty; reply ``ConfigRecord`` "node" = {"partition-id": int}.
* ``train`` (server -> the node of each sampled client, group id = round):
  "arrays" ``ArrayRecord``: the global parameters as the codec encoded them, in its dtype (fp16 travels as
  fp16, int8 as int8; bf16, which numpy lacks, as raw little-endian bytes with stype "torch.raw");
  "meta" ``ArrayRecord``: the codec's metadata, by parameter name (int8: its fp32 scales; empty otherwise);
  "config" ``ConfigRecord``: round, client-id, seed, codec, codec-block-size (int8's block size; absent:
  one scale per tensor), timeout-s, frozen (the parameters this client freezes this round, FFDAPT),
  experiment (the config's YAML, so nodes cannot drift from the server), and ``settings.<field>`` for every
  ``LocalSettings`` field. A key that is absent stands for None.
* reply: "arrays" and "meta" (the client's update exactly as ``fit_client`` encoded it, not re-encoded;
  without the frozen parameters),
  "metrics" ``MetricRecord`` (num-examples and the training metrics: train_loss, steps, examples), "config"
  {"client-id"}; or a Flower error reply whose reason reads like the simulator's failure reasons
  ("timeout: ...", "non-finite update: ...").

Upload bytes are ``ArrayRecord.count_bytes()`` of the reply's "arrays" plus "meta" (serialized arrays plus
their names); the upload's metadata bytes are those of "meta".

Deploy across machines (checked on one machine with flwr 1.41; every machine needs fedlm installed and
the data, the server too, for evaluation). Protocols that keep parameters on the clients (isolated,
sharing.critical_layer < L) are refused: the server evaluates each client's model, so run those in simulation.

    # server machine S: the SuperLink (one HTTP API for SuperNodes and for `flwr`)
    flower-superlink --insecure --host 0.0.0.0 --port 8000 --disable-runtime-dependency-installation
    # each client machine, i = 0..n-1 (several on one machine: give each its own --port)
    flower-supernode --insecure --superlink S:8000 --node-config "partition-id=i data-dir='/path/to/data'"
    # the launcher, with this in $FLWR_HOME/config.toml (default ~/.flwr/config.toml):
    #   [superlink.fedlm]
    #   address = "S:8000"
    #   insecure = true
    flwr run deploy/flower fedlm --stream \\
        --run-config "config='/path/on/S/experiment.yaml' data-dir='/path/on/S/data' run-dir='runs/flower'"

Run config keys (deploy/flower/pyproject.toml): config, data-dir, run-dir, node-wait-s (how long to wait
for every client's node at start), reply-timeout-s (how long a round waits for replies). With the default
subprocess isolation a SuperNode starts a fresh ClientApp process per message, so each round re-runs
``prepare`` on the node; the per-process cache pays off where ClientApps stay in one process (simulation).
Use TLS (--ssl-* / root certificates) instead of --insecure outside a trusted network.

Split learning (a config with a ``split`` section; trunk_mode sequential or parallel, client_parts share or
average): the ServerApp also serves the trunk over gRPC + TLS (run config ``trunk-listen``, ``trunk-address``,
``trunk-cert``, ``trunk-key``, ``trunk-ca``, ``trunk-tokens``, optional ``trunk-client-ca``), and each client
turn is one ``train`` message carrying the client parts it should load (``share``: those the previous client
finished with) plus "trunk-address" and "trunk-ca" (the CA's PEM) in its config. The node's ClientApp
trains its bottom and top against the trunk with its own token (node config ``trunk-token``; optional
``trunk-address`` / ``trunk-ca`` / ``trunk-client-cert`` / ``trunk-client-key`` override or add) and replies
with the same parts and its boundary byte counts in the metrics. Token ids, text and labels stay on the
node; the node never receives trained trunk weights. Checked across processes on one machine (SuperLink,
two SuperNodes, ``flwr run``; bf16 boundary): without dropout the run matches the simulator's to 1e-5 and
its boundary bytes exactly; with dropout the trunk's draws come from the server process's generator, not
the client's, so the runs differ as two seeds would. Each turn pays a fresh ClientApp process (~18 s here).

    flower-supernode ... --node-config "partition-id=i data-dir='/data' trunk-token='<client i token>'"
    flwr run deploy/flower fedlm --run-config "config='split.yaml' data-dir='/data' trunk-cert='s.pem' \
        trunk-key='s.key' trunk-ca='ca.pem' trunk-tokens='tokens.yaml' trunk-address='S:9100'"
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from fedlm.config import dump_config, read_yaml, validate
from fedlm.errors import UserError
from fedlm.federation.client_round import NonFiniteUpdate, fit_client
from fedlm.federation.codecs import Codec, Encoded, get_codec
from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import ClientTimeout, LocalSettings
from fedlm.federation.params import NamedTensors, all_finite, nbytes
from fedlm.federation.strategies import ClientUpdate
from fedlm.models.cut import Cut, SplitModel
from fedlm.run.prepare import Prepared, num_clients_of, prepare
from fedlm.run.recorder import slug
from fedlm.run.single import run_single
from fedlm.split.client import run_client_turn
from fedlm.split.grpc import GrpcTransport, load_tokens, serve_trunk
from fedlm.split.parts import client_copy
from fedlm.split.trunk import WIRE_DTYPES, TrunkBackend

log = logging.getLogger("fedlm")

RAW_STYPE = "torch.raw"
TRUNK_ADDRESS, TRUNK_CA = "trunk-address", "trunk-ca"
PARTITION_KEY = "partition-id"
DEFAULT_NODE_WAIT_S = 300.0
DEFAULT_REPLY_TIMEOUT_S = 3600.0


# ---- tensors <-> Flower arrays --------------------------------------------------------------------------


def to_array(tensor: torch.Tensor) -> Array:
    """One tensor as a Flower Array, keeping its dtype (numpy format, or raw bytes for bf16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        raw = tensor.reshape(-1).view(torch.int16).numpy().tobytes()
        return Array(dtype="bfloat16", shape=tuple(tensor.shape), stype=RAW_STYPE, data=raw)
    return Array(tensor.numpy())


def from_array(array: Array) -> torch.Tensor:
    if array.stype == RAW_STYPE:
        flat = torch.frombuffer(bytearray(array.data), dtype=getattr(torch, array.dtype))
        return flat.reshape(array.shape)
    return torch.from_numpy(array.numpy())


def to_array_record(tensors: NamedTensors) -> ArrayRecord:
    return ArrayRecord({name: to_array(t) for name, t in tensors.items()})


def from_array_record(record: ArrayRecord) -> NamedTensors:
    return {name: from_array(array) for name, array in record.items()}


# ---- what a train message carries -----------------------------------------------------------------------


def config_sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def encoded_from_records(arrays: ArrayRecord, meta: ArrayRecord, codec: str) -> Encoded:
    """What a codec encoded, rebuilt from its two records, with its bytes counted as the codec counts them."""
    tensors, scales = from_array_record(arrays), from_array_record(meta)
    return Encoded(tensors, codec, nbytes(tensors), nbytes(scales), scales)


def job_content(job: ClientJob, experiment: str, block_size: int | None = None,
                extra: dict[str, Any] | None = None) -> RecordDict:
    """A ClientJob as message content; None values are left out (absent = None).

    ``block_size`` is the codec's (``job.params`` does not say it), so the node can rebuild the codec;
    ``extra`` adds config entries (split learning: where the trunk is and the CA it is signed by).
    """
    values: dict[str, Any] = {**(extra or {}),
        "round": job.round_idx, "client-id": job.client_id, "seed": job.seed, "codec": job.params.codec,
        "codec-block-size": block_size, "timeout-s": job.timeout_s, "experiment": experiment,
        "frozen": list(job.frozen) or None,
        **{f"settings.{name}": value for name, value in asdict(job.settings).items()},
    }
    config = ConfigRecord({k: v for k, v in values.items() if v is not None})
    return RecordDict({"arrays": to_array_record(job.params.tensors), "meta": to_array_record(job.params.meta),
                       "config": config})


def job_from_content(content: RecordDict) -> tuple[ClientJob, str]:
    """The ClientJob (params still encoded) and the experiment YAML a train message carries."""
    config = content["config"]
    settings = LocalSettings(**{f.name: config.get(f"settings.{f.name}") for f in fields(LocalSettings)})
    params = encoded_from_records(content["arrays"], content["meta"], str(config["codec"]))
    job = ClientJob(int(config["client-id"]), int(config["round"]), params, settings, int(config["seed"]),
                    config.get("timeout-s"), tuple(config.get("frozen", [])))
    return job, str(config["experiment"])


def codec_from_content(content: RecordDict) -> Codec:
    """The codec a train message was encoded with: the node decodes and encodes with the server's codec."""
    config = content["config"]
    return get_codec(str(config["codec"]), config.get("codec-block-size"))


def report_content(report: ClientReport, upload: Encoded) -> RecordDict:
    """The reply to a train message; ``upload`` is the update as encoded (``report.update`` holds it decoded)."""
    update = report.update
    metrics = MetricRecord({"num-examples": update.num_examples, **update.metrics})
    return RecordDict({"arrays": to_array_record(upload.tensors), "meta": to_array_record(upload.meta),
                       "metrics": metrics, "config": ConfigRecord({"client-id": update.client_id})})


def failure_reason(exc: Exception) -> str:
    """The same wording as the in-process executor, so run records read alike."""
    if isinstance(exc, ClientTimeout):
        return f"timeout: {exc}"
    if isinstance(exc, NonFiniteUpdate):
        return f"non-finite update: {exc}"
    return f"exception: {type(exc).__name__}: {exc}"


# ---- server side ----------------------------------------------------------------------------------------


def discover_clients(grid: Grid, num_clients: int, wait_s: float, poll_s: float = 0.5) -> dict[int, int]:
    """Map fedlm client id -> Flower node id by asking each node its partition-id.

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
    """Sends each job to its client's node in one ``send_and_receive``; returns results in job order.

    Job order (not arrival order) keeps the aggregation's summation order, hence the result, identical to
    the in-process simulator's.
    """

    def __init__(self, grid: Grid, node_ids_by_client: dict[int, int], codec: Codec, experiment: str,
                 timeout_s: float | None = DEFAULT_REPLY_TIMEOUT_S,
                 progress: Callable[[int], None] | None = None, extra: dict[str, Any] | None = None) -> None:
        self.extra = extra
        self.grid = grid
        self.nodes = node_ids_by_client
        self.codec = codec
        self.experiment = experiment
        self.timeout_s = timeout_s
        self.progress = progress

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
            return ClientFailure(job.client_id, f"non-finite update: {exc}")
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            return ClientFailure(job.client_id, f"malformed reply: {type(exc).__name__}: {exc}")

    def _report(self, job: ClientJob, content: RecordDict) -> ClientReport:
        if int(content["config"]["client-id"]) != job.client_id:
            raise ValueError(f"reply is from client {content['config']['client-id']}, not {job.client_id}")
        arrays, meta = content["arrays"], content["meta"]
        received = encoded_from_records(arrays, meta, self.codec.name)
        skip = set(job.frozen)  # frozen this round: trained by nobody here, so not sent back
        _check_like(received.tensors, {n: t for n, t in job.params.tensors.items() if n not in skip}, "parameter")
        _check_like(received.meta, {n: t for n, t in job.params.meta.items() if n not in skip}, "metadata")
        params = self.codec.decode(received)
        bad = all_finite(params)
        if bad is not None:
            raise NonFiniteUpdate(f"parameter {bad} holds NaN or Inf")
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
                            timeout_s: float | None) -> Callable[..., FlowerExecutor]:
    """An ``executor_factory`` for ``run_single``: same signature as ``InProcessExecutor``'s constructor."""

    def factory(model: Any, task: Any, client_rows: Any, codec: Codec, store: Any, local_names: list[str],
                progress: Callable[[int], None] | None = None) -> FlowerExecutor:
        del model, task, client_rows, store  # they live on the nodes
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
    def from_settings(cls, context: Context, defaults: dict[str, Any]) -> TrunkService:
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
        return cls(str(_setting(context, "trunk-listen", defaults, "[::]:9100")),
                   _setting(context, "trunk-address", defaults), cert, key, read("trunk-ca", False) or cert,
                   load_tokens(str(tokens)), read("trunk-client-ca", False))


class FlowerSplitClients:
    """Split learning across machines: the ServerApp's process serves the trunk over gRPC + TLS, and each
    client turn is one Flower message to the client's node, whose ClientApp trains the client's parts
    against that trunk (``run_client_turn``) and replies with them. Implements ``RemoteClients``."""

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


def _setting(context: Context, key: str, defaults: dict[str, Any], fallback: Any = None) -> Any:
    """Run config (non-empty) first, then the app's defaults, then ``fallback``."""
    value = context.run_config.get(key)
    if value in (None, ""):
        value = defaults.get(key)
    return fallback if value in (None, "") else value


def build_server_app(**defaults: Any) -> ServerApp:
    """The ServerApp; ``defaults`` (config, data-dir, run-dir, ...) fill run config keys left empty."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        path = _setting(context, "config", defaults)
        if path is None:
            raise UserError("no experiment config: set the run config key 'config' to a YAML path")
        config = validate(read_yaml(Path(path)))
        run_dir = _setting(context, "run-dir", defaults, Path(config.output_dir) / slug(config.name))
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
        run_single(config, Path(_setting(context, "data-dir", defaults, ".")), Path(run_dir),
                   executor_factory=factory, split_remote=split_remote)

    return app


# ---- client side ----------------------------------------------------------------------------------------


class ClientRuntime:
    """A node's prepared data and model, built once per process and per experiment, reused every round.

    The lock keeps two ClientApp calls in one process from training the shared model at the same time.
    """

    def __init__(self, data_dir: str | None = None, trunk_tokens: dict[int, str] | None = None) -> None:
        self.data_dir = data_dir
        self.trunk_tokens = trunk_tokens or {}
        self.lock = threading.Lock()
        self._cache: tuple[tuple[str, str], Prepared] | None = None
        self._split_client: tuple[Prepared, SplitModel] | None = None

    def prepared(self, experiment: str, data_dir: str) -> Prepared:
        key = (config_sha(experiment), data_dir)
        if self._cache is None or self._cache[0] != key:
            config = validate(yaml.safe_load(experiment) or {})
            torch.manual_seed(config.seed)
            self._cache = key, prepare(config, Path(data_dir))
        return self._cache[1]

    def data_dir_of(self, context: Context) -> str:
        value = context.node_config.get("data-dir") or context.run_config.get("data-dir") or self.data_dir
        return str(value or ".")

    def query(self, msg: Message, context: Context) -> Message:
        try:
            content = RecordDict({"node": ConfigRecord({PARTITION_KEY: partition_id(context)})})
        except UserError as exc:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(exc)), reply_to=msg)
        return Message(content, reply_to=msg)

    def train(self, msg: Message, context: Context) -> Message:
        try:
            content = self._train(msg.content, context)
        except Exception as exc:  # a failed client answers with an error; the node stays up
            log.debug("client training failed", exc_info=True)
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, failure_reason(exc)), reply_to=msg)
        return Message(content, reply_to=msg)

    def _train(self, content: RecordDict, context: Context) -> RecordDict:
        job, experiment = job_from_content(content)
        own = partition_id(context)
        if job.client_id != own:
            raise UserError(f"job for client {job.client_id} reached the node of client {own}")
        with self.lock:
            prep = self.prepared(experiment, self.data_dir_of(context))
            if prep.config.split is not None:
                report, upload = run_client_turn(self.split_client(prep), prep.task,
                                                 prep.client_train[own], job, codec_from_content(content),
                                                 self.trunk_transport(content, context, prep, own))
                return report_content(report, upload)
            codec = KeepUpload(codec_from_content(content))
            report, _ = fit_client(prep.model, prep.task, prep.client_train[own], job, codec, None, [])
        if codec.upload is None:
            raise RuntimeError("fit_client encoded no upload")
        return report_content(report, codec.upload)

    def split_client(self, prep: Prepared) -> SplitModel:
        """This node's client parts (bottom and top; the trunk a ``meta`` placeholder), made once per prepared
        experiment."""
        if self._split_client is None or self._split_client[0] is not prep:
            spec = prep.config.split
            self._split_client = prep, client_copy(SplitModel(prep.model, Cut(spec.bottom_blocks, spec.top_blocks)))
        return self._split_client[1]

    def trunk_transport(self, content: RecordDict, context: Context, prep: Prepared, own: int) -> GrpcTransport:
        """A TLS session with the server's trunk: the address and CA the job names (node config
        ``trunk-address`` / ``trunk-ca`` override them), this node's ``trunk-token`` and, for mutual TLS,
        its ``trunk-client-cert`` / ``trunk-client-key``."""
        node, job = context.node_config, content["config"]
        token = node.get("trunk-token") or self.trunk_tokens.get(own)
        if not token:
            raise UserError("this SuperNode has no trunk token: add trunk-token='<token>' to its --node-config")
        ca = Path(str(node["trunk-ca"])).read_bytes() if node.get("trunk-ca") else str(job[TRUNK_CA]).encode()
        cert = None
        if node.get("trunk-client-cert"):
            cert = (Path(str(node["trunk-client-cert"])).read_bytes(),
                    Path(str(node["trunk-client-key"])).read_bytes())
        return GrpcTransport(str(node.get("trunk-address") or job[TRUNK_ADDRESS]), str(own), str(token),
                             root_cert_pem=ca, client_cert=cert, timeout_s=float(job.get("timeout-s", 600.0)),
                             wire_dtype=WIRE_DTYPES[prep.config.split.activation_dtype])


class KeepUpload:
    """A codec that remembers what it last encoded: fit_client's one encode is the upload, which the reply
    then carries as encoded (decoding and re-encoding int8 can move a scale by an ulp)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.name = codec.name
        self.block_size = codec.block_size
        self.upload: Encoded | None = None

    def encode(self, tensors: NamedTensors) -> Encoded:
        self.upload = self.codec.encode(tensors)
        return self.upload

    def decode(self, encoded: Encoded) -> NamedTensors:
        return self.codec.decode(encoded)


def partition_id(context: Context) -> int:
    value = context.node_config.get(PARTITION_KEY)
    if value is None:
        raise UserError("this SuperNode has no partition-id: start it with --node-config 'partition-id=<i>'")
    return int(value)


def build_client_app(data_dir: str | None = None, trunk_tokens: dict[int, str] | None = None) -> ClientApp:
    """The ClientApp; ``data_dir`` is used when neither node config nor run config names one, and
    ``trunk_tokens`` (by partition id) when a node's config has no ``trunk-token``."""
    runtime = ClientRuntime(data_dir, trunk_tokens)
    app = ClientApp()
    app.query()(runtime.query)
    app.train()(runtime.train)
    return app


server_app = build_server_app()
client_app = build_client_app()
