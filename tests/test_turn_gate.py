"""A split round sent to every client at once: the trunk's turn gate runs the turns in job order, so the round
equals the one sent turn by turn, whatever order the clients arrive in, and a failed client is skipped."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch
from flwr.app import Context, RecordDict
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fedlm.config import SplitConfig, validate
from fedlm.errors import UserError
from fedlm.federation.codecs import Codec, get_codec
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import snapshot
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies.fedavg import FedAvg
from fedlm.flower.placement import dispatch_wanted
from fedlm.models.build import build_model
from fedlm.run.prepare import prepare
from fedlm.split.certs import throwaway_certificates
from fedlm.split.client import call_trunk, client_steps, run_client_turn
from fedlm.split.executor import SplitExecutor
from fedlm.split.grpc_client import GrpcTransport
from fedlm.split.grpc_server import serve_trunk
from fedlm.split.parts import client_copy, split_model
from fedlm.split.transport import TransportError
from fedlm.split.trunk import TrunkBackend
from fedlm.split.turn_gate import TurnGate, TurnHook
from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = LocalSettings(lr=0.01, batch_size=8, local_steps=2, max_grad_norm=None)


# ------------------------------------------------------------------------------------------- the gate


def test_the_gate_admits_clients_in_round_order_whatever_order_they_arrive_in():
    gate, events = TurnGate(), []
    gate.open(["a", "b", "c"], lambda c: events.append(f"start {c}"), lambda c: events.append(f"end {c}"))

    def client(name: str, delay: float) -> None:
        time.sleep(delay)
        assert gate.admit(name)
        events.append(f"turn {name}")
        gate.end(name)

    threads = [threading.Thread(target=client, args=(name, delay)) for name, delay in (("c", 0), ("b", .05), ("a", .1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert events == ["start a", "turn a", "end a", "start b", "turn b", "end b", "start c", "turn c", "end c"]


def test_a_client_that_ends_before_its_turn_is_skipped_with_both_hooks_and_a_late_one_refused():
    gate, events = TurnGate(), []
    gate.open(["a", "b", "c"], lambda c: events.append(f"start {c}"), lambda c: events.append(f"end {c}"))
    gate.end("b")  # b failed before its turn (its reply came back without a session)
    assert gate.admit("a")
    gate.end("a")
    assert events == ["start a", "end a", "start b", "end b", "start c"]
    assert not gate.admit("b")  # its turn has passed: refused, not run out of order
    assert not gate.admit("x")  # not a client of this round
    gate.close()
    assert not gate.admit("c")  # the round is over


def test_closing_the_round_releases_and_refuses_waiting_clients():
    gate = TurnGate()
    gate.open(["a", "b"], lambda c: None, lambda c: None)
    answers: list[bool] = []
    waiter = threading.Thread(target=lambda: answers.append(gate.admit("b")))
    waiter.start()
    time.sleep(0.05)
    gate.close()
    waiter.join(timeout=10)
    assert answers == [False]
    assert not gate.admit("b")  # outside a round no session is served


def test_a_client_twice_in_one_round_is_refused():
    with pytest.raises(ValueError, match="twice"):
        TurnGate().open(["a", "a"], lambda c: None, lambda c: None)


# ------------------------------------------------------------------------ a round sent at once, in threads


class ThreadedNodes:
    """Clients on "other machines", each job run in its own thread as a Flower node would: a model copy with no
    trunk weights trains against this process's trunk over loopback gRPC + TLS with its own token. ``fail``:
    clients whose job raises before they reach the trunk; ``arrival``: the order the jobs of a round sent at
    once start in (a node's job starts when it polls, not in job order)."""

    def __init__(self, backend: TrunkBackend, codec: Codec, client: torch.nn.Module, spec: SplitConfig, prep,
                 fail: set[int], arrival: list[int]) -> None:
        self.codec, self.spec, self.prep, self.fail, self.arrival = codec, spec, prep, fail, arrival
        self.client = client_copy(split_model(client, spec))
        self.certs = throwaway_certificates("localhost")
        self.tokens = {str(cid): secrets.token_hex(8) for cid in prep.client_train}
        self.gate = TurnGate()
        self.server = serve_trunk(backend, "localhost:0", tokens=self.tokens, gate=self.gate,
                                  tls=(self.certs["server_cert"], self.certs["server_key"]))

    def _job(self, job: ClientJob) -> ClientReport | ClientFailure:
        if job.client_id in self.fail:
            return ClientFailure(job.client_id, "exception: the node went away")
        transport = GrpcTransport(f"localhost:{self.server.port}", str(job.client_id), self.tokens[str(job.client_id)],
                                  root_cert_pem=self.certs["ca"], timeout_s=60.0)
        client = client_copy(self.client)
        try:
            report, _ = run_client_turn(client, self.prep.task, self.prep.client_train[job.client_id], job, self.codec,
                                        transport)
        except TransportError as err:
            return ClientFailure(job.client_id, f"exception: {err}")
        return report

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        return self._through_gate(jobs, lambda c: None, lambda c: None, [job.client_id for job in jobs])

    def dispatches(self, jobs: list[ClientJob]) -> bool:
        return bool(self.arrival)

    def dispatch(self, jobs: list[ClientJob], on_start: TurnHook,
                 on_end: TurnHook) -> list[ClientReport | ClientFailure]:
        return self._through_gate(jobs, on_start, on_end, self.arrival)

    def _through_gate(self, jobs: list[ClientJob], on_start: TurnHook, on_end: TurnHook,
                      arrival: list[int]) -> list[ClientReport | ClientFailure]:
        self.gate.open([str(job.client_id) for job in jobs], on_start, on_end)
        results: dict[int, ClientReport | ClientFailure] = {}

        def node(job: ClientJob) -> None:
            results[job.client_id] = self._job(job)
            self.gate.end(str(job.client_id))  # its reply is in (the Flower executor's on_reply)

        by_id = {job.client_id: job for job in jobs}
        threads = [threading.Thread(target=node, args=(by_id[cid],)) for cid in arrival]
        try:
            for thread in threads:
                thread.start()
                time.sleep(0.02)
            for thread in threads:
                thread.join(timeout=120)
            return [results[job.client_id] for job in jobs]
        finally:
            self.gate.close()

    def close(self) -> None:
        self.server.stop(grace=1.0)


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_csv):
    raw = tiny_config(tmp_path_factory.mktemp("gate"), tiny_csv)
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    raw["train"]["local_steps"] = 2
    return prepare(validate(raw), tiny_csv)


def two_rounds(prep, mode: str, fail: set[int] = frozenset(), arrival: list[int] | None = None):
    """Two rounds of clients 0-2 through ThreadedNodes (sent turn by turn without ``arrival``); the global
    model after each round and each round's results."""
    model = build_model("bert", "tiny", "classification", prep.tokenizer, num_labels=2, seed=3)
    for module in model.modules():  # the nodes here are threads sharing torch's global generator, which each
        if isinstance(module, torch.nn.Dropout):  # job reseeds for its dropout; real nodes are processes
            module.p = 0.0
    spec = SplitConfig(trunk_mode=mode, client_parts="average", transport="grpc")
    remote = []

    def nodes(backend: TrunkBackend, codec: Codec) -> ThreadedNodes:
        remote.append(ThreadedNodes(backend, codec, model, spec, prep, set(fail), arrival or []))
        return remote[0]

    executor = SplitExecutor(model, spec, prep.task, prep.client_train, get_codec("fp32"), ClientStore({}), SETTINGS,
                             remote=nodes)
    state = snapshot(model, executor.parts.trunk + executor.parts.shared)
    models, outcomes = [], []
    try:
        for round_idx in (1, 2):
            executor.begin_round(round_idx, state)
            sent = get_codec("fp32").encode(executor.downlink(state))
            results = executor.run([ClientJob(cid, round_idx, sent, SETTINGS, seed=10 * round_idx + cid)
                                    for cid in (0, 1, 2)])
            reports = [r.update for r in results if isinstance(r, ClientReport)]
            state = {**FedAvg().aggregate(state, reports), **executor.server_params()}
            models.append(state)
            outcomes.append(results)
    finally:
        executor.close()
    return models, outcomes


@pytest.mark.parametrize("mode", ["sequential", "parallel"])
def test_a_round_sent_at_once_equals_the_round_sent_turn_by_turn(prep, mode):
    """The clients start in reverse order; the gate still runs them 0, 1, 2, each from the state it would have
    had (parallel: the round's trunk; sequential: the trunk the turn before left, with a fresh optimizer)."""
    expected, _ = two_rounds(prep, mode)
    got, outcomes = two_rounds(prep, mode, arrival=[2, 1, 0])
    assert all(isinstance(r, ClientReport) for results in outcomes for r in results)
    for want, have in zip(expected, got, strict=True):
        assert set(have) == set(want)
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)


def test_a_client_that_fails_before_its_turn_is_skipped_and_the_round_completes(prep):
    expected, expected_outcomes = two_rounds(prep, "sequential", fail={1})
    got, outcomes = two_rounds(prep, "sequential", fail={1}, arrival=[2, 0, 1])
    for results in (*expected_outcomes, *outcomes):
        assert [type(r) for r in results] == [ClientReport, ClientFailure, ClientReport]
    for want, have in zip(expected, got, strict=True):
        for name in want:
            torch.testing.assert_close(have[name], want[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------- the run config key


@pytest.mark.parametrize(("value", "in_memory", "expected"), [
    (None, False, True),  # a deployment: every node its own process
    (None, True, False),  # Flower's in-process simulation: a waiting node could hold the only worker
    ("false", False, False),
    ("true", True, True),
    ("sometimes", False, "use auto, true or false"),
])
def test_split_dispatch_is_on_in_a_deployment_and_off_in_flowers_simulation(value, in_memory, expected):
    settings = {} if value is None else {"split-dispatch": value}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=settings)
    grid = InMemoryGrid.__new__(InMemoryGrid) if in_memory else object()
    if isinstance(expected, str):
        with pytest.raises(UserError, match=expected):
            dispatch_wanted(context, {}, grid)
    else:
        assert dispatch_wanted(context, {}, grid) is expected


def test_a_session_whose_turn_ended_is_refused_mid_session(prep):
    """A straggler: the round ended (its reply was given up on) while its session was open; its next message is
    refused before it reaches the trunk."""
    model = build_model("bert", "tiny", "classification", prep.tokenizer, num_labels=2, seed=3)
    spec = SplitConfig(trunk_mode="sequential", client_parts="average", transport="grpc")
    executor = SplitExecutor(model, spec, prep.task, prep.client_train, get_codec("fp32"), ClientStore({}), SETTINGS,
                             remote=lambda backend, codec: ThreadedNodes(backend, codec, model, spec, prep, set(), []))
    nodes = executor.clients.remote
    try:
        nodes.gate.open(["0"], lambda c: None, lambda c: None)
        transport = GrpcTransport(f"localhost:{nodes.server.port}", "0", nodes.tokens["0"],
                                  root_cert_pem=nodes.certs["ca"], timeout_s=30.0)
        client = client_copy(nodes.client)
        steps = client_steps(client, prep.task, prep.client_train[0], SETTINGS, 0, None)
        request = next(steps)
        answer = call_trunk(transport, request)  # admitted: its first forward is answered
        nodes.gate.close()
        with pytest.raises(TransportError, match="not this client's turn"):
            call_trunk(transport, steps.send(answer))
        transport.close()
    finally:
        executor.close()
