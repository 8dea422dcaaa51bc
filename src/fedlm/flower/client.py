"""fedlm's Flower ClientApp: a SuperNode is fedlm client ``partition-id`` and trains as the simulator does.

A ``train`` message runs ``fit_client`` (FedAvg family) or ``run_client_turn`` against the server's trunk
(split learning), the same functions the in-process simulator calls, on data prepared on the node from the
experiment the message carries; a ``query`` message answers which client this node is.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch
import yaml
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.client_round import failure_reason, fit_client
from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.params import NamedTensors
from fedlm.flower.messages import (
    PARTITION_KEY,
    TRUNK_ADDRESS,
    TRUNK_CA,
    codec_from_content,
    config_sha,
    job_from_content,
    report_content,
)
from fedlm.models.cut import SplitModel
from fedlm.run.prepare import Prepared, prepare
from fedlm.split.client import run_client_turn
from fedlm.split.grpc import GrpcTransport
from fedlm.split.parts import client_copy, split_model
from fedlm.split.trunk import WIRE_DTYPES

log = logging.getLogger("fedlm")


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
            self._split_client = prep, client_copy(split_model(prep.model, spec))
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
    """Which fedlm client this SuperNode is (node config ``partition-id``)."""
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


client_app = build_client_app()
