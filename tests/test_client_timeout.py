"""A client stuck inside a step is cut off at its deadline, in simulation and on a Flower node, and what it
does afterwards reaches neither the round, the run's model, the client store nor the next client."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from fedlm.config import SplitConfig, dump_config, validate
from fedlm.federation.client_round import ClientAbandoned, call_with_deadline, fit_client
from fedlm.federation.codecs import get_codec
from fedlm.federation.engine import EngineHooks, RoundEngine, RoundPlan
from fedlm.federation.executor import ClientFailure, ClientJob
from fedlm.federation.local_training import LocalSettings, local_seed
from fedlm.federation.params import snapshot, trainable_names
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import FedAvg
from fedlm.flower.client import ClientRuntime
from fedlm.flower.executor import FlowerExecutor
from fedlm.flower.messages import job_content
from fedlm.models.build import build_model
from fedlm.run.prepare import prepare
from fedlm.split.executor import SplitExecutor
from tests.conftest import tiny_config
from tests.test_flower import ScriptedGrid, over_the_wire
from tests.test_flower import task_identity as task_identity  # a fixture

TIMEOUT_S = 3.0
STUCK_S = TIMEOUT_S + 4.0  # a step that sleeps past the deadline

pytestmark = pytest.mark.usefixtures("one_thread")


def stuck_once(model: torch.nn.Module, seconds: float) -> threading.Event:
    """Make ``model``'s next forward sleep ``seconds`` (a step that hangs); the event is set when it wakes."""
    woke = threading.Event()

    def hang(module, args):
        handle.remove()
        time.sleep(seconds)
        woke.set()

    handle = model.register_forward_pre_hook(hang)
    return woke


def test_call_with_deadline_returns_raises_or_abandons():
    assert call_with_deadline(lambda: 7, 5.0) == 7
    with pytest.raises(KeyError):
        call_with_deadline(lambda: {}["missing"], 5.0)
    started = time.monotonic()
    with pytest.raises(ClientAbandoned, match=r"still working at its 0\.2s deadline; abandoned"):
        call_with_deadline(lambda: time.sleep(3), 0.2)
    assert time.monotonic() - started < 1.5


def _engine(prep, fit_fn, rounds: int) -> tuple[RoundEngine, list[dict]]:
    records: list[dict] = []
    store = ClientStore({})
    executor = InProcessExecutor(prep.model, prep.task, prep.client_train, get_codec("fp32"), store, [], fit_fn=fit_fn)
    plan = RoundPlan(rounds=rounds, clients_per_round=4, min_clients=1, max_retries=0, timeout_s=TIMEOUT_S,
                     seed=prep.config.seed)
    engine = RoundEngine(FedAvg(), executor, get_codec("fp32"), list(prep.client_train),
                         LocalSettings.from_config(prep.config.train), plan,
                         EngineHooks(record=lambda r: records.append(r.to_dict())))
    return engine, records


def test_simulation_abandons_a_stuck_client_at_its_deadline_and_keeps_nothing_of_it(tmp_path, tiny_csv):
    """Client 1 hangs inside its first step of round 1. The round goes on at its deadline without it; once
    the hung step returns, the abandoned worker stops; the rounds equal, bit for bit, a run where client 1
    simply failed in round 1."""
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    prep = prepare(cfg, tiny_csv)
    initial = snapshot(prep.model, trainable_names(prep.model))
    woke: list[threading.Event] = []

    def hangs_in_round_1(model, task, rows, job, *rest, **kwargs):
        if job.client_id == 1 and job.round_idx == 1:
            woke.append(stuck_once(model, STUCK_S))
        return fit_client(model, task, rows, job, *rest, **kwargs)

    engine, records = _engine(prep, hangs_in_round_1, rounds=1)
    started = time.monotonic()
    after_1 = engine.run_round(1, dict(initial))
    assert time.monotonic() - started < TIMEOUT_S + 2.5  # not STUCK_S: the round stopped waiting
    assert records[0]["clients"] == [0, 2, 3]
    assert records[0]["failed"] == [{"client": 1, "reason": "timeout: still working at its 3s deadline; abandoned"}]
    run_model = {n: t.clone() for n, t in prep.model.state_dict().items()}
    assert woke[0].wait(STUCK_S + 5)  # the hung step returns ...
    time.sleep(0.5)  # ... and its worker runs into the stop at its next module
    assert not any(t.name == "fedlm-client-1" and t.is_alive() for t in threading.enumerate())
    assert all(torch.equal(t, run_model[n]) for n, t in prep.model.state_dict().items())
    after_2 = engine.run_round(2, after_1)  # client 1 trains again, on a fresh copy

    reference = prepare(cfg, tiny_csv)

    def fails_in_round_1(model, task, rows, job, *rest, **kwargs):
        if job.client_id == 1 and job.round_idx == 1:
            raise RuntimeError("down")
        return fit_client(model, task, rows, job, *rest, **kwargs)

    ref_engine, ref_records = _engine(reference, fails_in_round_1, rounds=1)
    ref_1 = ref_engine.run_round(1, dict(initial))
    ref_2 = ref_engine.run_round(2, ref_1)
    assert ref_records[1]["clients"] == records[1]["clients"] == [0, 1, 2, 3]
    for name in initial:
        assert torch.equal(after_1[name], ref_1[name]), name
        assert torch.equal(after_2[name], ref_2[name]), name


def test_a_deadline_that_is_not_reached_changes_nothing(tmp_path, tiny_csv):
    """Without a timeout clients train the run's model in this thread; with one, a copy in a worker thread:
    the same round, bit for bit."""
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    rounds = {}
    for timeout_s in (None, 60.0):
        prep = prepare(cfg, tiny_csv)
        where = []

        def recording(model, task, rows, job, *rest, where=where, prep=prep, **kwargs):
            where.append((threading.current_thread() is threading.main_thread(), model is prep.model))
            return fit_client(model, task, rows, job, *rest, **kwargs)

        engine, _ = _engine(prep, recording, rounds=1)
        engine.plan.timeout_s = timeout_s
        rounds[timeout_s] = engine.run_round(1, snapshot(prep.model, trainable_names(prep.model)))
        assert set(where) == ({(True, True)} if timeout_s is None else {(False, False)})
    for name, value in rounds[None].items():
        assert torch.equal(value, rounds[60.0][name]), name


# ---- on a Flower node ---------------------------------------------------------------------------------


def _node_job(prep, client_id: int, timeout_s: float | None) -> ClientJob:
    params = get_codec("fp32").encode(snapshot(prep.model, trainable_names(prep.model)))
    return ClientJob(client_id, 1, params, LocalSettings.from_config(prep.config.train),
                     local_seed(prep.config.seed, 1, client_id), timeout_s)


def _context(partition: int) -> Context:
    return Context(run_id=1, node_id=partition, node_config={"partition-id": partition}, state=RecordDict(),
                   run_config={})


def test_a_flower_node_answers_timeout_at_the_deadline_and_trains_the_next_job_afresh(task_identity, tmp_path,
                                                                                      tiny_csv):
    """The node's ClientRuntime (what its ClientApp calls for a train message): a job whose step hangs is
    answered with a timeout at its deadline; the next job, sent while the abandoned worker still sleeps on
    the old model, trains a newly prepared one and uploads what a fresh node uploads."""
    cfg = validate(tiny_config(tmp_path, tiny_csv))
    experiment, data_dir = dump_config(cfg), str(tiny_csv)
    job = _node_job(prepare(cfg, tiny_csv), 2, TIMEOUT_S)

    def send(runtime: ClientRuntime) -> Message:
        msg = over_the_wire(Message(job_content(job, experiment), dst_node_id=7, message_type="train"))
        return runtime.train(msg, _context(2))

    node = ClientRuntime(data_dir)
    assert not send(node).has_error()  # prepares the node's experiment and trains normally
    woke = stuck_once(node.prepared(experiment, data_dir).model, STUCK_S)
    started = time.monotonic()
    stuck = send(node)
    assert time.monotonic() - started < TIMEOUT_S + 2.0
    assert stuck.has_error() and stuck.error.reason == "timeout: still working at its 3s deadline; abandoned"
    again = send(node)
    assert not again.has_error() and not woke.is_set()
    fresh = send(ClientRuntime(data_dir))
    for name in fresh.content["arrays"]:
        assert (again.content["arrays"][name].numpy() == fresh.content["arrays"][name].numpy()).all(), name


def test_the_server_waits_for_the_clients_deadline_plus_grace_not_the_reply_timeout(task_identity):
    calls = []

    def silent(msg: Message) -> None:
        calls.append(msg.metadata.ttl)

    grid = ScriptedGrid({100: silent})
    executor = FlowerExecutor(grid, {0: 100}, get_codec("fp32"), "name: x", timeout_s=3600.0, grace_s=2.0)
    params = get_codec("fp32").encode({"w": torch.ones(2)})
    job = ClientJob(0, 1, params, LocalSettings(), seed=1, timeout_s=5.0)
    [result] = executor.run([job])
    assert isinstance(result, ClientFailure) and result.reason == "timeout: no reply within 7s"
    assert grid.timeouts == [7.0] and calls == [7.0]  # the job's time to live too
    no_limit = ClientJob(0, 1, params, LocalSettings(), seed=1, timeout_s=None)
    executor.run([no_limit])
    assert grid.timeouts[-1] == 3600.0


# ---- split learning in simulation ---------------------------------------------------------------------


class HangingTask:
    """``task`` whose ``collate`` sleeps ``STUCK_S`` (or raises, ``fail=True``) once, in the first batch of
    the client whose rows it is given: a client computation stuck between two trunk messages."""

    def __init__(self, task, rows: list[dict], fail: bool = False) -> None:
        self.task, self.rows, self.fail = task, {id(r) for r in rows}, fail
        self.armed = False
        self.woke = threading.Event()

    def __getattr__(self, name):
        return getattr(self.task, name)

    def collate(self, rows, generator):
        if self.armed and id(rows[0]) in self.rows:
            self.armed = False
            if self.fail:
                raise RuntimeError("down")
            time.sleep(STUCK_S)
            self.woke.set()
        return self.task.collate(rows, generator)


def _split_rounds(prep, mode: str, fail: bool, rounds: int = 2, timeout_s: float | None = TIMEOUT_S,
                  hang: bool = True):
    """``rounds`` split rounds of 3 clients with ``client_timeout_s``, client 1 hanging (or failing) in its
    first batch of round 1: (global params after the rounds, per-round outcomes, round times, trunk check)."""
    settings = LocalSettings(lr=0.01, batch_size=8, local_steps=2, max_grad_norm=None)
    model = build_model("bert", "tiny", "classification", prep.tokenizer, num_labels=2, seed=3)
    task = HangingTask(prep.task, list(prep.client_train[1]), fail=fail)
    store = ClientStore({})
    executor = SplitExecutor(model, SplitConfig(trunk_mode=mode, client_parts="average"), task,
                             prep.client_train, get_codec("fp32"), store, settings)
    store.initial = snapshot(model, executor.parts.local)
    params = snapshot(model, executor.parts.trunk + executor.parts.shared)
    outcomes, took = [], []
    for round_idx in range(1, rounds + 1):
        task.armed = hang and round_idx == 1
        executor.begin_round(round_idx, params)
        sent = get_codec("fp32").encode(executor.downlink(params))
        jobs = [ClientJob(cid, round_idx, sent, settings, seed=100 + cid, timeout_s=timeout_s) for cid in range(3)]
        started = time.monotonic()
        results = executor.run(jobs)
        took.append(time.monotonic() - started)
        outcomes.append([r.reason if isinstance(r, ClientFailure) else "ok" for r in results])
        reports = [r.update for r in results if not isinstance(r, ClientFailure)]
        if reports:
            params = {**FedAvg().aggregate(params, reports), **executor.server_params()}
        if round_idx == 1 and hang and not fail:
            trunk_after_round_1 = executor.trunk()
            assert task.woke.wait(STUCK_S + 5)  # the hung step returns ...
            time.sleep(0.5)  # ... and its worker runs into the stop at its next module
            assert not any(t.name == "fedlm-client-1" and t.is_alive() for t in threading.enumerate())
            assert all(torch.equal(t, executor.trunk()[n]) for n, t in trunk_after_round_1.items())
    executor.close()
    return params, outcomes, took


@pytest.fixture(scope="module")
def three_clients(tmp_path_factory, tiny_csv):
    raw = tiny_config(tmp_path_factory.mktemp("split_timeout"), tiny_csv)
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    return prepare(validate(raw), tiny_csv)


ABANDONED = "timeout: still working at its 3s deadline; abandoned"


def test_split_simulation_abandons_a_client_stuck_between_trunk_messages(three_clients):
    """Client 1 hangs in its first batch of round 1 (client-side computation, before any trunk message). The
    round goes on at the deadline without it; the abandoned worker never reaches the trunk (its session is
    closed and its model copy stops at its next module); both rounds equal, bit for bit, a run where
    client 1 failed at the same point."""
    stuck, stuck_outcomes, took = _split_rounds(three_clients, "sequential", fail=False)
    assert took[0] < TIMEOUT_S + 2.5  # not STUCK_S: the round stopped waiting
    assert stuck_outcomes == [["ok", ABANDONED, "ok"], ["ok"] * 3]
    failed, failed_outcomes, _ = _split_rounds(three_clients, "sequential", fail=True)
    assert failed_outcomes[0][1].endswith("down") and failed_outcomes[1] == ["ok"] * 3
    assert set(stuck) == set(failed)
    for name in stuck:
        assert torch.equal(stuck[name], failed[name]), name


def test_a_client_batch_waits_for_its_stuck_member_only_until_the_deadline(three_clients):
    """In lockstep the batch waits at the trunk for every member, so a member stuck at the deadline holds the
    others up to it: the round ends at the deadline with the stuck client abandoned (and the others out of
    time), the trunk untouched by the abandoned worker, and the next round trains all three."""
    _, outcomes, took = _split_rounds(three_clients, "client_batch", fail=False)
    assert took[0] < TIMEOUT_S + 2.5
    assert outcomes[0][1] == ABANDONED and all(o.startswith("timeout:") for o in outcomes[0])
    assert outcomes[1] == ["ok"] * 3


@pytest.mark.parametrize("mode", ["sequential", "client_batch"])
def test_a_split_deadline_that_is_not_reached_changes_nothing(three_clients, mode):
    """With a deadline the client's computation runs in worker threads, without one in this thread: the same
    rounds, bit for bit."""
    free, free_outcomes, _ = _split_rounds(three_clients, mode, fail=False, timeout_s=None, hang=False)
    timed, timed_outcomes, _ = _split_rounds(three_clients, mode, fail=False, timeout_s=60.0, hang=False)
    assert free_outcomes == timed_outcomes == [["ok"] * 3] * 2
    for name in free:
        assert torch.equal(free[name], timed[name]), name
