"""The Flower path against the in-process simulator: same seed, same global model; and its failure paths.

flwr 1.41's simulation runtime ships only a Ray backend. Without Ray, ``run_simulation`` runs here with a
thread backend put where the runtime loads its backend from; everything else is Flower's: the ServerApp in
its own thread, the in-memory SuperLink state, the InMemoryGrid, the node registry (which hands each node
its partition-id), and the ClientApp. Every message also makes a round trip through Flower's wire format
(deflated to bytes and inflated again) on its way to and from the ClientApp.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
import yaml
from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.server.superlink.fleet.vce.backend import Backend
from flwr.serverapp import Grid
from flwr.simulation import run_simulation
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.task_identity import TaskIdentity

from fedlm.config import ExperimentConfig, dump_config, validate
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.strategies import ClientUpdate
from fedlm.flower.app import build_server_app
from fedlm.flower.client import build_client_app, client_app
from fedlm.flower.executor import FlowerExecutor
from fedlm.flower.localdeploy import trunk_credentials
from fedlm.flower.messages import (
    codec_from_content,
    from_array_record,
    job_content,
    job_from_content,
    report_content,
    to_array_record,
)
from fedlm.flower.nodes import discover_clients
from fedlm.flower.relay import RelayStore
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import tiny_config
from tests.training_helpers import assert_saved_classifiers_close

CLIENT_ERROR = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
RAY_BACKEND_MODULE = "flwr.server.superlink.fleet.vce.backend.raybackend"


def over_the_wire(message: Message) -> Message:
    """Serialize a message into Flower's object contents (bytes) and rebuild it from them alone."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    rebuilt = inflate_object_from_contents(message.object_id, contents)
    rebuilt.metadata.__dict__["_message_id"] = message.metadata.message_id  # the link assigns ids
    return rebuilt


class ThreadBackend(Backend):
    """Runs each ClientApp call in this process, one at a time."""

    def __init__(self, backend_config: dict) -> None:
        super().__init__(backend_config)
        self.app_fn = None

    def build(self, app_fn) -> None:
        self.app_fn = app_fn

    @property
    def num_workers(self) -> int:
        return 1

    def is_worker_idle(self) -> bool:
        return True

    def terminate(self) -> None:
        pass

    def process_message(self, message: Message, context: Context) -> tuple[Message, Context]:
        reply = self.app_fn()(over_the_wire(message), context)
        return over_the_wire(reply), context


@pytest.fixture
def no_telemetry(monkeypatch):
    monkeypatch.setattr("flwr.supercore.telemetry.FLWR_TELEMETRY_ENABLED", "0")


def run_through_flower(monkeypatch, num_nodes: int, trunk_tokens: dict[int, str] | None = None,
                       **server_defaults) -> None:
    backend_module = types.ModuleType(RAY_BACKEND_MODULE)
    backend_module.RayBackend = ThreadBackend
    monkeypatch.setitem(sys.modules, RAY_BACKEND_MODULE, backend_module)
    run_simulation(server_app=build_server_app(**server_defaults),
                   client_app=build_client_app(server_defaults["data-dir"], trunk_tokens),
                   num_supernodes=num_nodes, backend_name="thread")


def run_in_simulator_and_flower(monkeypatch, config: ExperimentConfig, data_dir: Path, tmp_path: Path,
                                trunk_tokens: dict[int, str] | None = None,
                                settings: dict | None = None) -> tuple[list[dict], list[dict]]:
    """``config`` run by the simulator into ``tmp_path / "sim"``, then through three in-process Flower nodes into
    ``tmp_path / "flower"`` (``settings``: more ServerApp settings); both runs' records."""
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(dump_config(config))
    run_single(config, data_dir, tmp_path / "sim")
    run_through_flower(monkeypatch, 3, trunk_tokens, **{"config": str(config_path), "data-dir": str(data_dir),
                                                        "run-dir": str(tmp_path / "flower")}, **(settings or {}))
    return read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "flower")


def count_relayed_updates(monkeypatch) -> list[int]:
    """The client ids whose updates the ServerApp took from the relay, in order."""
    taken: list[int] = []
    take = RelayStore.take_upload

    def counting(self, client_id: int, digest: str) -> bytes:
        taken.append(client_id)
        return take(self, client_id, digest)

    monkeypatch.setattr(RelayStore, "take_upload", counting)
    return taken


@pytest.mark.parametrize(("codec", "sharing", "framing", "relay"), [
    ({"codec": "fp16"}, {}, 1.05, False),
    ({"codec": "int8", "codec_block_size": 64}, {}, 1.2, False),
    ({"codec": "fp16"}, {"freeze_window": {"epsilon": 1}}, 1.05, False),  # FFDAPT: frozen blocks are not sent back
    ({"codec": "int8", "codec_block_size": 64}, {}, 1.2, True),  # parameters beside the messages, on the relay
    ({"codec": "fp32", "aggregator": "median"}, {}, 1.05, False),  # a node that attacks, a robust server
])
def test_two_fedavg_rounds_through_flower_equal_the_simulator(codec, sharing, framing, relay, tmp_path, tiny_csv,
                                                              monkeypatch, no_telemetry):
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2, **codec)
    raw["partition"]["num_clients"] = 3
    raw["sharing"] = sharing
    if "aggregator" in codec:  # the attack is the node's own doing: its ClientApp sends the flipped change
        raw["attack"] = {"kind": "sign_flip", "clients": [1], "scale": 3.0}
    service, tokens = trunk_credentials(tmp_path / "relay", [0, 1, 2]) if relay else ({}, None)
    taken = count_relayed_updates(monkeypatch)
    sim, fl = run_in_simulator_and_flower(monkeypatch, validate(raw), tiny_csv, tmp_path, tokens, service)
    assert taken == ([c for r in fl[1:] for c in r["clients"]] if relay else [])
    assert [r["round"] for r in fl] == [0, 1, 2]
    assert sim[0]["test_accuracy"] == fl[0]["test_accuracy"]  # the same starting point
    for a, b in zip(sim[1:], fl[1:], strict=True):
        assert a["clients"] == b["clients"] and len(b["clients"]) == 2 and not b["failed"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-6)
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-6)
        assert (a["bytes_down"], a["bytes_down_meta"]) == (b["bytes_down"], b["bytes_down_meta"])
        # arrays travel in the codec's dtype: the upload is the simulator's payload plus each array's framing
        # (npy header, name), which weighs more next to int8's quarter-size arrays and their scales
        assert a["bytes_up"] < b["bytes_up"] < a["bytes_up"] * framing
        assert a["bytes_up_meta"] <= b["bytes_up_meta"] and (a["bytes_up_meta"] > 0) == (codec["codec"] == "int8")

    assert_saved_classifiers_close(tmp_path / "sim" / "model", tmp_path / "flower" / "model")


@pytest.mark.parametrize(("trunk_mode", "client_parts", "relay"), [("sequential", "share", True),
                                                                   ("parallel", "average", False)])
def test_split_rounds_through_flower_equal_the_simulator(trunk_mode, client_parts, relay, tmp_path, tiny_csv,
                                                         monkeypatch, no_telemetry):
    """Each client turn is a Flower message; the node trains its parts against the ServerApp's trunk over
    gRPC + TLS with its own token (and, with the relay, fetches and returns its parts over the trunk's server).
    Same batches and the same fp32 boundary as the simulator: same model."""
    raw = tiny_config(tmp_path, tiny_csv)
    raw["partition"]["num_clients"] = 3
    raw["split"] = {"trunk_mode": trunk_mode, "client_parts": client_parts, "transport": "grpc"}
    trunk, tokens = trunk_credentials(tmp_path / "trunk", [0, 1, 2])
    taken = count_relayed_updates(monkeypatch)
    sim, fl = run_in_simulator_and_flower(monkeypatch, validate(raw), tiny_csv, tmp_path, tokens,
                                          {**trunk, "relay": relay})
    assert taken == ([c for r in fl[1:] for c in r["clients"]] if relay else [])
    assert [r["round"] for r in fl] == [0, 1, 2]
    for a, b in zip(sim[1:], fl[1:], strict=True):
        assert a["clients"] == b["clients"] and not b["failed"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-6)
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-6)
        assert (a["bytes_up_boundary"], a["bytes_down_boundary"]) == (b["bytes_up_boundary"],
                                                                      b["bytes_down_boundary"])
    assert_saved_classifiers_close(tmp_path / "sim" / "model", tmp_path / "flower" / "model")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_arrays_keep_dtype_and_values_through_the_wire(dtype):
    tensors = {"w": (torch.randn(3, 5) * 100).to(dtype), "b": torch.arange(4).to(dtype)}
    record = to_array_record(tensors)
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(record).items()}
    back = from_array_record(inflate_object_from_contents(record.object_id, contents))
    assert list(back) == ["w", "b"]
    for name, value in tensors.items():
        assert back[name].dtype == dtype and torch.equal(back[name], value), name


# ---- the executor's failure handling, with a scripted Grid ----------------------------------------------


@pytest.fixture
def task_identity(monkeypatch):
    """Messages are stamped with the task's identity; outside a Flower process, make one up."""
    for attr, value in (("_run_id", 1), ("_task_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)


class ScriptedGrid(Grid):
    """Answers each node's message with what ``script[node](message)`` returns (None: no reply)."""

    def __init__(self, script) -> None:
        self.script = script
        self.timeouts: list[float | None] = []

    def get_node_ids(self) -> Iterable[int]:
        return list(self.script)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        self.timeouts.append(timeout)
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{msg.metadata.dst_node_id}"
            reply = self.script[msg.metadata.dst_node_id](over_the_wire(msg))
            if reply is not None:
                replies.append(over_the_wire(reply))
        return replies

    # the executor uses only the calls above
    def set_run(self, run) -> None: ...
    def run(self): ...
    def create_message(self, *args, **kwargs): ...
    def push_messages(self, messages): ...
    def pull_messages(self, message_ids): ...


def echo(scale: float = 1.0, names: list[str] | None = None):
    """A client that sends back what it got, times ``scale``, with 10 examples."""

    def handle(msg: Message) -> Message:
        job, _ = job_from_content(msg.content)
        codec = codec_from_content(msg.content)
        params = {n: t * scale for n, t in codec.decode(job.params).items()}
        if names is not None:
            params = {new: params[old] for new, old in zip(names, params, strict=True)}
        report = ClientReport(ClientUpdate(job.client_id, 10, params, {"train_loss": 0.5}), 0)
        return Message(report_content(report, codec.encode(params)), reply_to=msg)

    return handle


def _job(client_id: int, codec: str = "fp16", block_size: int | None = None) -> ClientJob:
    params = get_codec(codec, block_size).encode({"w": torch.ones(2, 3), "b": torch.zeros(3)})
    return ClientJob(client_id, 1, params, LocalSettings(max_grad_norm=None, local_steps=3), seed=11,
                     timeout_s=None)


def test_executor_turns_replies_into_reports_and_failures(task_identity):
    grid = ScriptedGrid({
        100: echo(2.0),
        101: lambda msg: Message(Error(CLIENT_ERROR, "exception: RuntimeError: disk on fire"), reply_to=msg),
        102: lambda msg: None,
        103: echo(names=["x", "b"]),
        104: echo(float("nan")),
    })
    nodes = {0: 100, 1: 101, 2: 102, 3: 103, 4: 104}
    seen = []
    executor = FlowerExecutor(grid, nodes, get_codec("fp16"), "name: x", timeout_s=5.0,
                              observer=types.SimpleNamespace(client_done=seen.append))
    results = executor.run([_job(cid) for cid in (0, 1, 2, 3, 4, 5)])

    report = results[0]
    assert isinstance(report, ClientReport) and report.update.client_id == 0
    assert report.update.num_examples == 10 and report.update.metrics["train_loss"] == 0.5
    assert torch.equal(report.update.params["w"], torch.full((2, 3), 2.0))
    assert report.update.params["w"].dtype == torch.float32
    assert report.upload_bytes > (6 + 3) * 2  # fp16 payload plus framing
    reasons = {r.client_id: r.reason for r in results if isinstance(r, ClientFailure)}
    assert reasons[1] == "exception: RuntimeError: disk on fire"
    assert reasons[2].startswith("timeout: no reply within 5s")
    assert reasons[3].startswith("malformed reply")
    assert reasons[4].startswith("non-finite update")
    assert reasons[5] == "no Flower node serves client 5"
    assert [type(r).__name__ for r in results] == ["ClientReport"] + ["ClientFailure"] * 5
    assert seen == [0, 1, 2, 3, 4, 5] and grid.timeouts == [5.0]


def test_job_travels_with_all_settings_and_none_values(task_identity):
    job = _job(3, codec="bf16")
    msg = over_the_wire(Message(job_content(job, "name: x\n"), dst_node_id=7, message_type="train"))
    back, experiment = job_from_content(msg.content)
    assert experiment == "name: x\n"
    assert back.settings == job.settings and back.settings.max_grad_norm is None
    assert (back.client_id, back.round_idx, back.seed, back.timeout_s) == (3, 1, 11, None)
    assert back.params.codec == "bf16" and back.params.tensors["w"].dtype == torch.bfloat16
    assert back.params.payload_bytes == job.params.payload_bytes


def test_int8_job_and_reply_carry_scales_and_block_size(task_identity):
    job = _job(0, codec="int8", block_size=4)
    content = over_the_wire(Message(job_content(job, "name: x\n", 4), dst_node_id=7, message_type="train")).content
    back, _ = job_from_content(content)
    codec = codec_from_content(content)
    assert (codec.name, codec.block_size) == ("int8", 4)
    assert back.params.tensors["w"].dtype == torch.int8 and back.params.meta["w"].shape == (2,)  # 6 values, blocks of 4
    assert (back.params.payload_bytes, back.params.meta_bytes) == (9, 3 * 4)  # 2 scales for w, 1 for b
    for name in ("w", "b"):
        assert torch.equal(back.params.tensors[name], job.params.tensors[name])
        assert torch.equal(back.params.meta[name], job.params.meta[name])

    grid = ScriptedGrid({100: echo(-3.0)})
    executor = FlowerExecutor(grid, {0: 100}, get_codec("int8", 4), "name: x", timeout_s=5.0)
    [report] = executor.run([job])
    assert isinstance(report, ClientReport)
    assert torch.equal(report.update.params["w"], torch.full((2, 3), -3.0))
    assert report.update.params["w"].dtype == torch.float32
    assert report.upload_meta_bytes >= 3 * 4 and report.upload_bytes >= 9 + report.upload_meta_bytes


def test_discovery_maps_partitions_to_nodes_and_rejects_duplicates(task_identity):
    def node(pid):
        return lambda msg: client_app(msg, _context(pid))

    grid = ScriptedGrid({10: node(1), 11: node(0), 12: node(7)})
    assert discover_clients(grid, 2, wait_s=5) == {0: 11, 1: 10}
    with pytest.raises(Exception, match="both claim partition-id 0"):
        discover_clients(ScriptedGrid({10: node(0), 11: node(0)}), 2, wait_s=5)


def test_client_app_answers_a_misrouted_or_broken_job_with_an_error(task_identity, tmp_path, tiny_csv):
    experiment = dump_config(validate(tiny_config(tmp_path, tiny_csv)))
    msg = over_the_wire(Message(job_content(_job(2), experiment), dst_node_id=7, message_type="train"))
    reply = client_app(msg, _context(1))
    assert reply.has_error() and "reached the node of client 1" in reply.error.reason
    broken = yaml.safe_dump({"name": "x"})  # no data section: the config does not validate
    msg = over_the_wire(Message(job_content(_job(1), broken), dst_node_id=7, message_type="train"))
    reply = client_app(msg, _context(1))
    assert reply.has_error() and reply.error.reason.startswith("exception: UserError")


def _context(partition: int) -> Context:
    return Context(run_id=1, node_id=partition, node_config={"partition-id": partition}, state=RecordDict(),
                   run_config={})
