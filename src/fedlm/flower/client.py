"""fedlm's Flower ClientApp: a SuperNode is fedlm client ``partition-id`` and trains as the simulator does.

A ``train`` message runs ``fit_client`` (FedAvg family) or ``run_client_turn`` against the server's trunk
(split learning), the same functions the in-process simulator calls, on data prepared on the node from the
experiment the message carries; a ``query`` message answers which client this node is.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import yaml
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.client_round import (
    ClientAbandoned,
    call_with_deadline,
    failure_reason,
    fit_client,
    stop_at_next_module,
)
from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.executor import ClientJob, ClientReport
from fedlm.federation.params import NamedTensors
from fedlm.flower.messages import (
    PARTITION_KEY,
    TRUNK_ADDRESS,
    TRUNK_CA,
    TURN_WAIT,
    codec_from_content,
    config_sha,
    is_relayed,
    job_from_content,
    report_content,
)
from fedlm.flower.relay import RelayClient
from fedlm.flower.secagg import masked_reply
from fedlm.flower.secagg_mod import SECURE_KEY, secure_aggregation_mod
from fedlm.models.cut import SplitModel
from fedlm.run.prepare import Prepared, prepare
from fedlm.split.client import run_client_turn
from fedlm.split.grpc_client import GrpcTransport
from fedlm.split.modes import TrunkChoice
from fedlm.split.parts import client_copy, split_model

log = logging.getLogger("fedlm")


class ClientRuntime:
    """A node's prepared data and model, built once per process and per experiment, reused every round.

    The lock keeps two ClientApp calls in one process from training the shared model at the same time. A
    job with ``timeout-s`` trains in a worker thread that is abandoned at its deadline (the node answers
    with a timeout at once); the abandoned worker keeps the model, so the node prepares a new one.
    """

    def __init__(self, data_dir: str | None = None, trunk_tokens: dict[int, str] | None = None) -> None:
        self.data_dir = data_dir
        self.trunk_tokens = trunk_tokens or {}
        self.lock = threading.Lock()
        self._cache: tuple[tuple[str, str], Prepared] | None = None
        self.prepares = 0  # how often an experiment was prepared (the node worker's cache at work)
        self._split_client: tuple[Prepared, SplitModel] | None = None

    def prepared(self, experiment: str, data_dir: str) -> Prepared:
        key = (config_sha(experiment), data_dir)
        if self._cache is None or self._cache[0] != key:
            config = validate(yaml.safe_load(experiment) or {})
            torch.manual_seed(config.seed)
            self._cache = key, prepare(config, Path(data_dir))
            self.prepares += 1
        return self._cache[1]

    def data_dir_of(self, context: Context) -> str:
        """Node config first (each machine has its own paths), then run config, then the app's default."""
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
            content = self.answer(msg.content, context)
        except Exception as exc:  # a failed client answers with an error; the node stays up
            log.debug("client training failed", exc_info=True)
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, failure_reason(exc)), reply_to=msg)
        return Message(content, reply_to=msg)

    def answer(self, content: RecordDict, context: Context) -> RecordDict:
        """The reply content to a ``train`` message's content; raises when the client fails."""
        own = partition_id(context)
        relay = self.relay_client(content, context, own) if is_relayed(content) else None
        try:
            return self._answer(content, context, own, relay)
        finally:
            if relay is not None:
                relay.close()

    def _answer(self, content: RecordDict, context: Context, own: int, relay: RelayClient | None) -> RecordDict:
        job, experiment = job_from_content(content, None if relay is None else relay.fetch)
        if job.client_id != own:
            raise UserError(f"job for client {job.client_id} reached the node of client {own}")
        with self.lock:
            prep = self.prepared(experiment, self.data_dir_of(context))
            session: GrpcTransport | None = None
            if prep.config.split is not None:
                if content["config"].get(SECURE_KEY):
                    raise UserError("secure aggregation is for the FedAvg family, not split learning")
                client = self.split_client(prep)
                session = self.trunk_transport(content, context, prep, own)
                held = client.model
                work = partial(run_client_turn, client, prep.task, prep.client_train[own], job,
                               codec_from_content(content), session)
            else:
                codec = KeepUpload(codec_from_content(content))
                held = prep.model
                work = partial(self._fit, prep, job, codec, own)
            try:
                report, upload = call_with_deadline(work, job.timeout_s, name=f"fedlm-client-{own}")
            except ClientAbandoned:
                self.abandon(held)
                if session is not None:
                    session.close()  # the abandoned worker cannot reach the trunk again
                raise
        if content["config"].get(SECURE_KEY):  # secure_aggregation_mod masks it
            update = report.update
            return masked_reply(upload, job, codec_from_content(content), update.num_examples, update.metrics,
                                content["config"])
        return report_content(report, upload, None if relay is None else relay.upload)

    @staticmethod
    def _fit(prep: Prepared, job: ClientJob, codec: KeepUpload, own: int) -> tuple[ClientReport, Encoded]:
        report, _ = fit_client(prep.model, prep.task, prep.client_train[own], job, codec, None, [], attack=prep.attack)
        if codec.upload is None:
            raise RuntimeError("fit_client encoded no upload")
        return report, codec.upload

    def abandon(self, model: torch.nn.Module) -> None:
        """A job ran past its deadline: its worker keeps ``model`` (stopped at its next module call), and
        the next job prepares the experiment afresh rather than share it."""
        stop_at_next_module(model)
        self._cache = None
        self._split_client = None

    def split_client(self, prep: Prepared) -> SplitModel:
        """This node's client parts (bottom and top; the trunk a ``meta`` placeholder), made once per prepared
        experiment."""
        if self._split_client is None or self._split_client[0] is not prep:
            spec = prep.config.split
            self._split_client = prep, client_copy(split_model(prep.model, spec))
        return self._split_client[1]

    def service_access(self, content: RecordDict, context: Context, own: int) -> ServiceAccess:
        """How this node reaches the ServerApp's gRPC service (trunk, relay): the address and CA the job
        names (node config ``trunk-address`` / ``trunk-ca`` override them), this node's ``trunk-token`` and,
        for mutual TLS, its ``trunk-client-cert`` / ``trunk-client-key``."""
        node, job = context.node_config, content["config"]
        token = node.get("trunk-token") or self.trunk_tokens.get(own)
        if not token:
            raise UserError("this SuperNode has no trunk token: add trunk-token='<token>' to its --node-config")
        ca = Path(str(node["trunk-ca"])).read_bytes() if node.get("trunk-ca") else str(job[TRUNK_CA]).encode()
        cert = None
        if node.get("trunk-client-cert"):
            cert = (Path(str(node["trunk-client-cert"])).read_bytes(),
                    Path(str(node["trunk-client-key"])).read_bytes())
        wait = job.get(TURN_WAIT)
        return ServiceAccess(str(node.get("trunk-address") or job[TRUNK_ADDRESS]), str(token), ca, cert,
                             float(job.get("timeout-s", 600.0)), None if wait is None else float(wait))

    def trunk_transport(self, content: RecordDict, context: Context, prep: Prepared, own: int) -> GrpcTransport:
        """A TLS session with the server's trunk (``service_access``)."""
        access = self.service_access(content, context, own)
        return GrpcTransport(access.address, str(own), access.token, root_cert_pem=access.ca,
                             client_cert=access.client_cert, timeout_s=access.timeout_s,
                             first_timeout_s=access.turn_wait_s,
                             wire_dtype=TrunkChoice.of(prep.config.split).wire_dtype)

    def relay_client(self, content: RecordDict, context: Context, own: int) -> RelayClient:
        """Where this job's parameters wait and its update goes (``service_access``)."""
        access = self.service_access(content, context, own)
        return RelayClient(access.address, str(own), access.token, access.ca, access.client_cert, access.timeout_s)


@dataclass(frozen=True)
class ServiceAccess:
    address: str
    token: str
    ca: bytes
    client_cert: tuple[bytes, bytes] | None
    timeout_s: float
    turn_wait_s: float | None = None  # the first trunk answer's wait when a round is sent at once


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
    """Which fedlm client this SuperNode is (node config ``partition-id``)."""
    value = context.node_config.get(PARTITION_KEY)
    if value is None:
        raise UserError("this SuperNode has no partition-id: start it with --node-config 'partition-id=<i>'")
    return int(value)


def build_client_app(data_dir: str | None = None, trunk_tokens: dict[int, str] | None = None,
                     runtime: ClientRuntime | None = None) -> ClientApp:
    """The ClientApp training in its own process; ``data_dir`` is used when neither node config nor run
    config names one, and ``trunk_tokens`` (by partition id) when a node's config has no ``trunk-token``.
    Deployed SuperNodes load ``fedlm.flower.nodeapp``, which trains in a long-lived worker instead."""
    runtime = runtime or ClientRuntime(data_dir, trunk_tokens)
    app = ClientApp()
    app.query()(runtime.query)
    app.train(mods=[secure_aggregation_mod])(runtime.train)
    return app


in_process_runtime = ClientRuntime()
client_app = build_client_app(runtime=in_process_runtime)
