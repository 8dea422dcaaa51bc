"""Secure aggregation through Flower's SecAgg+: the ServerApp sees masked vectors, the aggregate is FedAvg's.

The protocol is Flower's (``SecAggPlusWorkflow`` on the server, ``secaggplus_mod`` on the nodes); these tests
check fedlm's use of it: what reaches the ServerApp per client, the aggregate against the simulator's within
SecAgg+'s quantization bound (``fedlm.flower.secagg.error_bound``), and rounds with dropouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import bytes_to_ndarray
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import weighted_mean
from fedlm.flower import secagg
from fedlm.flower.messages import codec_from_content, job_content, job_from_content
from fedlm.flower.placement import secure_settings
from fedlm.flower.secagg import SecAggSettings, error_bound, masked_reply, quantization_range
from fedlm.flower.secagg_mod import secure_aggregation_mod
from fedlm.flower.secure_executor import SecureFlowerExecutor
from tests.conftest import tiny_config
from tests.test_flower import (
    ScriptedGrid,
    no_telemetry,
    over_the_wire,
    run_in_simulator_and_flower,
    task_identity,
)
from tests.training_helpers import assert_saved_classifiers_close

__all__ = ["no_telemetry", "task_identity"]  # fixtures used here

SIZES = {0: 30, 1: 50, 2: 20}  # each client's example count (its SecAgg+ weight)


def client_delta(client_id: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + client_id)
    return {"w": torch.randn(4, 6, generator=gen) * 0.1, "b": torch.randn(6, generator=gen) * 0.1}


def secure_node(client_id: int, fail: bool = False):
    """A node: Flower's SecAgg+ mod (through fedlm's) around a trainer that adds a known delta."""
    app = ClientApp()

    def train(msg: Message, context: Context) -> Message:
        if fail:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "exception: RuntimeError: lost power"),
                           reply_to=msg)
        job, _ = job_from_content(msg.content)
        codec = codec_from_content(msg.content)
        trained = {n: t + client_delta(client_id)[n] for n, t in codec.decode(job.params).items()}
        content = masked_reply(codec.encode(trained), job, codec, SIZES[client_id], {"train_loss": 0.25},
                               msg.content["config"])
        return Message(content, reply_to=msg)

    app.train(mods=[secure_aggregation_mod])(train)
    context = Context(run_id=1, node_id=client_id, node_config={"partition-id": client_id}, state=RecordDict(),
                      run_config={})
    return lambda msg: app(msg, context)


def dropping_node(client_id: int, stage: str, silent: bool = True):
    """A node that answers as :func:`secure_node` until ``stage``, then drops: no reply (``silent``) or the
    SuperLink's word that the node is gone."""
    node = secure_node(client_id)

    def handle(msg: Message) -> Message | None:
        if msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] != stage:
            return node(msg)
        return None if silent else Message(Error(ErrorCode.NODE_UNAVAILABLE, "gone"), reply_to=msg)

    return handle


class WatchingGrid(ScriptedGrid):
    """Keeps every reply the ServerApp receives."""

    def __init__(self, script) -> None:
        super().__init__(script)
        self.received: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        self.received.extend(replies)
        return replies


GLOBAL = {"w": torch.linspace(-1, 1, 24).reshape(4, 6), "b": torch.zeros(6)}


def _jobs(clients) -> list[ClientJob]:
    params = get_codec("fp32").encode(GLOBAL)
    return [ClientJob(cid, 3, params, LocalSettings(), seed=5) for cid in clients]


def _expected(clients) -> dict[str, torch.Tensor]:
    return weighted_mean([({n: GLOBAL[n] + d for n, d in client_delta(c).items()}, float(SIZES[c]))
                          for c in clients])


def test_server_receives_masked_vectors_and_the_weighted_mean(task_identity):
    grid = WatchingGrid({10 + c: secure_node(c) for c in SIZES})
    executor = SecureFlowerExecutor(grid, {c: 10 + c for c in SIZES}, get_codec("fp32"), "name: x",
                                    SecAggSettings(), SIZES, timeout_s=5.0)
    results = executor.run(_jobs(SIZES))
    assert all(isinstance(r, ClientReport) for r in results)
    expected = _expected(SIZES)
    bound = error_bound(3, [n / max(SIZES.values()) for n in SIZES.values()], 8.0)
    assert bound < 1e-7  # a fine grid: 2**30 levels for 3 clients
    for report in results:
        assert report.update.num_examples == SIZES[report.update.client_id]
        assert report.update.metrics == {"train_loss": 0.25}
        for name, value in expected.items():
            got = report.update.params[name]
            assert got.dtype == torch.float32 and got.shape == value.shape
            assert (got - value).abs().max() <= bound + 1e-7, name  # + fp32 rounding of the result

    masked = [r for r in grid.received if r.has_content() and Key.MASKED_PARAMETERS in
              r.content.config_records[RECORD_KEY_CONFIGS]]
    assert len(masked) == 3
    t = quantization_range(3)
    for reply in masked:
        assert all(len(record) == 0 for record in reply.content.array_records.values())  # no plain update
        vectors = [bytes_to_ndarray(b) for b in
                   reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        values = np.concatenate([v.ravel() for v in vectors[1:]])  # [0] is the weight
        # unmasked, every quantized value of a small delta sits within T/8 of T/2 (fraction 1); masked, they
        # spread uniformly over [0, 2**32), so the expected fraction there is 2 * (T/8) / 2**32 = 1/16. With
        # 30 values a bound of 0.2 failed about 1 run in 35 (binomial tail, 3 replies); 0.5 fails about once in 1e10.
        assert np.mean(np.abs(values - t / 2) < t / 8) < 0.5
        assert values.min() >= 0 and values.max() < 2**32 and values.std() > 2**32 / 8


def test_a_dropout_below_the_threshold_leaves_the_others_aggregate(task_identity):
    grid = ScriptedGrid({10: secure_node(0), 11: secure_node(1), 12: secure_node(2, fail=True)})
    executor = SecureFlowerExecutor(grid, {c: 10 + c for c in SIZES}, get_codec("fp32"), "name: x",
                                    SecAggSettings(threshold=2), SIZES, timeout_s=5.0)
    results = executor.run(_jobs(SIZES))
    assert isinstance(results[2], ClientFailure) and results[2].reason == "exception: RuntimeError: lost power"
    expected = _expected([0, 1])
    bound = error_bound(2, [SIZES[0] / 50, SIZES[1] / 50], 8.0)
    for report in results[:2]:
        assert isinstance(report, ClientReport)
        for name, value in expected.items():
            assert (report.update.params[name] - value).abs().max() <= bound + 1e-7, name


def test_too_many_dropouts_halt_the_round_with_reasons(task_identity):
    grid = ScriptedGrid({10: secure_node(0), 11: secure_node(1, fail=True), 12: lambda msg: None})
    executor = SecureFlowerExecutor(grid, {c: 10 + c for c in SIZES}, get_codec("fp32"), "name: x",
                                    SecAggSettings(threshold=2), SIZES, timeout_s=5.0)
    results = executor.run(_jobs(SIZES))
    assert all(isinstance(r, ClientFailure) for r in results)
    reasons = [r.reason for r in results]
    assert reasons[0] == ("secure aggregation halted: node 11 (client 1) dropped before sending its masked vector, "
                          "node 12 (client 2) dropped in setup, before sharing keys; too few nodes stayed to rebuild "
                          "the masks (SecAgg+ threshold 2)")
    assert reasons[1] == "exception: RuntimeError: lost power"
    assert reasons[2].startswith("timeout: no reply in the secure aggregation's setup stage")


@pytest.mark.parametrize("stage", [Stage.SETUP, Stage.SHARE_KEYS])
def test_a_node_dropped_before_its_key_shares_went_out_leaves_the_others_aggregate(task_identity, stage):
    """Nobody masked with it nor holds a share of its key: Flower's workflow still asked the others to unmask
    it, and every such round halted (their records: ``secure aggregation: 12``) however many nodes stayed."""
    grid = ScriptedGrid({10: secure_node(0), 11: secure_node(1), 12: dropping_node(2, stage)})
    executor = SecureFlowerExecutor(grid, {c: 10 + c for c in SIZES}, get_codec("fp32"), "name: x",
                                    SecAggSettings(threshold=2), SIZES, timeout_s=5.0)
    results = executor.run(_jobs(SIZES))
    name = stage.replace("_", " ")
    assert isinstance(results[2], ClientFailure)
    assert results[2].reason == f"timeout: no reply in the secure aggregation's {name} stage"
    expected = _expected([0, 1])
    bound = error_bound(2, [SIZES[0] / 50, SIZES[1] / 50], 8.0)
    for report in results[:2]:
        assert isinstance(report, ClientReport), report
        for key, value in expected.items():
            assert (report.update.params[key] - value).abs().max() <= bound + 1e-7, key


@pytest.mark.parametrize("stage", [Stage.SETUP, Stage.SHARE_KEYS])
def test_every_node_dropped_before_the_shares_went_out_halts_the_round(task_identity, stage):
    """Left out of the round one by one, no node stays: the round halts (it must not go on with none)."""
    grid = ScriptedGrid({10 + c: dropping_node(c, stage) for c in SIZES})
    executor = SecureFlowerExecutor(grid, {c: 10 + c for c in SIZES}, get_codec("fp32"), "name: x",
                                    SecAggSettings(threshold=2), SIZES, timeout_s=5.0)
    name = stage.replace("_", " ")
    assert [r.reason for r in executor.run(_jobs(SIZES))] == \
        [f"timeout: no reply in the secure aggregation's {name} stage"] * 3


@pytest.mark.parametrize(("stage", "silent", "dropped", "own"), [
    (Stage.SETUP, True, "in setup, before sharing keys", "timeout: no reply in the secure aggregation's setup stage"),
    (Stage.SHARE_KEYS, False, "while sharing keys", "node unavailable: node 12 stopped sending heartbeats"),
    (Stage.COLLECT_MASKED_VECTORS, True, "before sending its masked vector", "timeout: no reply in the secure "
     "aggregation's collect masked vectors stage"),
    (Stage.UNMASK, True, "while unmasking", "timeout: no reply in the secure aggregation's unmask stage"),
])
def test_a_halted_round_names_the_dropped_node_in_the_live_clients_records(task_identity, stage, silent, dropped,
                                                                           own):
    """Threshold 3 of 3: any dropout halts the round. The live clients' records say whose, and when; the
    dropped client keeps its own reason."""
    grid = ScriptedGrid({10: secure_node(0), 11: secure_node(1), 12: dropping_node(2, stage, silent)})
    executor = SecureFlowerExecutor(grid, {c: 10 + c for c in SIZES}, get_codec("fp32"), "name: x",
                                    SecAggSettings(threshold=3), SIZES, timeout_s=5.0)
    results = executor.run(_jobs(SIZES))
    assert all(isinstance(r, ClientFailure) for r in results)
    halted = (f"secure aggregation halted: node 12 (client 2) dropped {dropped}; too few nodes stayed to rebuild "
              "the masks (SecAgg+ threshold 3)")
    assert [r.reason for r in results[:2]] == [halted, halted]
    assert results[2].reason.startswith(own)


def test_live_nodes_refusing_for_want_of_a_dropped_nodes_share_name_that_node(task_identity, monkeypatch):
    """Should the protocol still ask the live nodes for a share they never got (Flower's own workflow does,
    for a node gone before its key shares went out), their records name the dropped node, not a bare id."""
    monkeypatch.setattr(secagg._FedlmSecAggPlus, "_check_threshold", SecAggPlusWorkflow._check_threshold)
    grid = WatchingGrid({10: secure_node(0), 11: secure_node(1), 12: dropping_node(2, Stage.SHARE_KEYS)})
    executor = SecureFlowerExecutor(grid, {c: 10 + c for c in SIZES}, get_codec("fp32"), "name: x",
                                    SecAggSettings(threshold=2), SIZES, timeout_s=5.0)
    results = executor.run(_jobs(SIZES))
    refusals = [r.error.reason for r in grid.received if r.has_error()]
    assert refusals == ["secure aggregation: KeyError: 12"] * 2  # the nodes' own word, named by its type
    halted = ("secure aggregation halted: node 12 (client 2) dropped while sharing keys; too few nodes stayed to "
              "rebuild the masks (SecAgg+ threshold 2)")
    assert [r.reason for r in results] == [halted, halted, "timeout: no reply in the secure aggregation's share "
                                           "keys stage"]


def test_node_refuses_plain_updates_and_oversized_deltas(task_identity):
    app = ClientApp()
    app.train(mods=[secure_aggregation_mod])(lambda msg, ctx: Message(RecordDict(), reply_to=msg))
    plain = over_the_wire(Message(job_content(_jobs([0])[0], "name: x"), dst_node_id=7, message_type="train"))
    strict = Context(run_id=1, node_id=7, node_config={"require-secure-aggregation": "true"}, state=RecordDict(),
                     run_config={})
    reply = app(plain, strict)
    assert reply.has_error() and "only through secure aggregation" in reply.error.reason
    job = _jobs([0])[0]
    codec = get_codec("fp32")
    config = job_content(job, "x", extra={secagg.MAX_WEIGHT_KEY: 30.0, secagg.CLIPPING_KEY: 0.5})["config"]
    with pytest.raises(Exception, match="beyond SecAgg\\+'s clipping range"):
        masked_reply(codec.encode({n: t + 1.0 for n, t in GLOBAL.items()}), job, codec, 30, {}, config)
    with pytest.raises(Exception, match="more than the server's SecAgg\\+ max weight"):
        masked_reply(codec.encode(GLOBAL), job, codec, 31, {}, config)


def test_secure_fedavg_rounds_through_flower_match_the_simulator(tmp_path, tiny_csv, monkeypatch, no_telemetry):
    """The real ClientApp under Flower's runtime: the aggregate agrees with the simulator's within SecAgg+'s
    quantization (2 clients of equal size: 1.5e-8 per value), which two rounds of training keep small."""
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2, codec="fp16")
    raw["partition"]["num_clients"] = 3
    seen: list[Message] = []
    original = secagg._RecordingGrid.send_and_receive

    def watch(self, messages, *, timeout=None):
        replies = original(self, messages, timeout=timeout)
        seen.extend(replies)
        return replies

    monkeypatch.setattr(secagg._RecordingGrid, "send_and_receive", watch)
    sim, fl = run_in_simulator_and_flower(monkeypatch, validate(raw), tiny_csv, tmp_path,
                                          settings={"secure-aggregation": True})
    assert [r["round"] for r in fl] == [0, 1, 2]
    for a, b in zip(sim[1:], fl[1:], strict=True):
        assert a["clients"] == b["clients"] and len(b["clients"]) == 2 and not b["failed"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-5)
        assert a["test_accuracy"] == pytest.approx(b["test_accuracy"], abs=1e-6)
    assert_saved_classifiers_close(tmp_path / "sim" / "model", tmp_path / "flower" / "model", atol=1e-5)
    # every train reply the ServerApp got carried no parameters in the clear, only SecAgg+'s records
    assert len(seen) == 2 * 4 * 2  # 2 rounds x 4 stages x 2 nodes
    assert all(not record for reply in seen for record in reply.content.array_records.values())


def test_bad_secagg_settings_are_one_line_errors():
    values = {"secagg-num-shares": 3, "secagg-threshold": 3}
    with pytest.raises(UserError, match="must be less than `num_shares`"):
        SecAggSettings.from_settings(lambda key, default: values.get(key, default))
    with pytest.raises(UserError, match="secagg-threshold: expected a positive count or fraction"):
        SecAggSettings.from_settings(lambda key, default: -1 if key == "secagg-threshold" else default)


def test_client_level_dp_is_refused_under_secure_aggregation(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2)
    raw["privacy"] = {"kind": "client", "noise_multiplier": 1.0, "clip": 1.0}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"secure-aggregation": True})
    with pytest.raises(UserError, match=r"privacy\.kind: client clips"):
        secure_settings(context, {}, validate(raw))
