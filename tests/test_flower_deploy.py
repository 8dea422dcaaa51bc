"""Deployed nodes: the ClientApp a SuperNode loads hands training to a long-lived worker process.

A SuperNode starts a fresh ClientApp process per message; the worker keeps the prepared experiment, so a
node prepares once per experiment instead of once per message. These tests start real worker processes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from fedlm.config import dump_config, validate
from fedlm.federation.codecs import get_codec
from fedlm.federation.engine import RoundEngine
from fedlm.federation.executor import ClientJob
from fedlm.federation.local_training import LocalSettings
from fedlm.flower import localdeploy, nodeapp
from fedlm.flower.client import build_client_app
from fedlm.flower.localdeploy import LocalDeployment, flower_binaries_available, trunk_credentials
from fedlm.flower.messages import from_array_record, job_content
from fedlm.run.prepare import prepare
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import tiny_config
from tests.test_flower import no_telemetry, over_the_wire, run_through_flower, task_identity
from tests.training_helpers import assert_saved_classifiers_close

__all__ = ["no_telemetry", "task_identity"]  # fixtures used here


@pytest.fixture
def runtime_dir(monkeypatch):
    """A short private folder for the workers' sockets (a Unix socket path has at most 107 bytes)."""
    folder = tempfile.mkdtemp(prefix="fl")
    monkeypatch.setenv("XDG_RUNTIME_DIR", folder)
    yield folder
    _kill_workers_under(folder)  # a worker a test started outlives it otherwise (its parent is pytest's parent)
    shutil.rmtree(folder, ignore_errors=True)


def _kill_workers_under(folder: str) -> None:
    """SIGKILL every process whose command line names ``folder`` (the node workers, by their socket path)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if folder in cmdline.read_bytes().decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):  # gone meanwhile, or not ours
            continue


def _train_message(experiment: str, params: dict[str, torch.Tensor], round_idx: int) -> Message:
    job = ClientJob(1, round_idx, get_codec("fp32").encode(params), LocalSettings(), seed=round_idx)
    return over_the_wire(Message(job_content(job, experiment), dst_node_id=7, message_type="train"))


def test_node_worker_prepares_once_answers_like_the_in_process_app_and_survives_a_kill(
        tmp_path, tiny_csv, runtime_dir, task_identity):
    config = validate(tiny_config(tmp_path, tiny_csv))
    experiment = dump_config(config)
    torch.manual_seed(config.seed)
    params = {n: p.detach().clone() for n, p in prepare(config, tiny_csv).model.named_parameters()}
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "data-dir": str(tiny_csv),
                                                        "threads": 1}, state=RecordDict(), run_config={})
    link = nodeapp.WorkerLink(*nodeapp.worker_paths(1, str(tiny_csv)))  # runtime_dir's teardown stops it
    first = nodeapp.client_app(_train_message(experiment, params, 1), context)
    reference = build_client_app()(_train_message(experiment, params, 1), context)
    assert not first.has_error() and not reference.has_error()
    got, want = from_array_record(first.content["arrays"]), from_array_record(reference.content["arrays"])
    assert list(got) == list(want)
    for name, value in want.items():
        assert torch.allclose(got[name], value, atol=1e-6), name
    assert first.content["metrics"]["num-examples"] == reference.content["metrics"]["num-examples"]

    nodeapp.client_app(_train_message(experiment, params, 2), context)
    status = nodeapp.worker_status(link)
    assert status["prepares"] == 1  # the second message reused the prepared experiment
    assert status["threads"] == 1  # the node config's threads reached the worker

    os.kill(status["pid"], signal.SIGKILL)  # the worker dies between jobs: the next job starts another
    again = nodeapp.client_app(_train_message(experiment, params, 3), context)
    assert not again.has_error()
    restarted = nodeapp.worker_status(link)
    assert restarted["pid"] != status["pid"] and restarted["prepares"] == 1


def test_node_threads_must_be_a_positive_integer(task_identity):
    msg = _train_message("experiment", {"w": torch.zeros(2)}, 1)
    for bad in ("two", 0, -1):
        reply = nodeapp.client_app(msg, Context(run_id=1, node_id=7, node_config={"partition-id": 0,
                                                                                  "threads": bad},
                                                state=RecordDict(), run_config={}))
        assert reply.has_error() and f"threads={bad!r}" in reply.error.reason


def test_a_local_deployment_divides_the_cores_among_its_nodes(monkeypatch):
    monkeypatch.setattr(localdeploy, "cores", lambda: 16)
    assert [c["threads"] for c in localdeploy.share_cores([{"partition-id": i} for i in range(4)])] == [4] * 4
    assert [c["threads"] for c in localdeploy.share_cores([{}] * 20)] == [1] * 20  # never below one
    assert localdeploy.share_cores([{"threads": 3}, {}]) == [{"threads": 3}, {"threads": 8}]  # a set value wins


def test_node_app_answers_queries_without_the_training_stack(task_identity):
    msg = over_the_wire(Message(RecordDict(), dst_node_id=7, message_type="query"))
    reply = nodeapp.client_app(msg, Context(run_id=1, node_id=7, node_config={"partition-id": 4},
                                            state=RecordDict(), run_config={}))
    assert reply.content["node"]["partition-id"] == 4
    reply = nodeapp.client_app(msg, Context(run_id=1, node_id=7, node_config={}, state=RecordDict(),
                                            run_config={}))
    assert reply.has_error() and "no partition-id" in reply.error.reason


@pytest.mark.skipif(not flower_binaries_available() or os.environ.get("FEDLM_SKIP_DEPLOY_TEST") == "1",
                    reason="Flower's flower-superlink / flower-supernode / flwr are not installed (or "
                           "FEDLM_SKIP_DEPLOY_TEST=1)")
def test_real_processes_run_two_rounds_and_survive_a_killed_node(tmp_path, tiny_csv, runtime_dir):
    """SuperLink, two SuperNodes and ``flwr run`` as subprocesses, the parameters on fedlm's relay (TLS, a token
    per node): round 1 with both clients; then client 1's
    SuperNode is killed (kill -9) and round 2 goes on without it, recording why. About 2 minutes on a busy
    2-core machine (the processes' imports, and round 2's 30 s wait for the dead node); set
    FEDLM_SKIP_DEPLOY_TEST=1 to leave it out."""
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2)
    raw["partition"]["num_clients"] = 2
    config = validate(raw)
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(dump_config(config))
    run_dir = tmp_path / "flower-run"
    relay, tokens = trunk_credentials(tmp_path / "relay", [0, 1])  # parameters on the relay, as deployed
    nodes = [{"partition-id": i, "data-dir": str(tiny_csv), "trunk-token": tokens[i]} for i in range(2)]
    for i in range(2):  # start the nodes' workers now (fedlm's import), so round 1 fits the reply timeout
        nodeapp.WorkerLink(*nodeapp.worker_paths(i, str(tiny_csv))).connect().close()
    with LocalDeployment(tmp_path / "deploy", nodes) as deployment:
        process = deployment.start_run({"config": str(config_path), "data-dir": str(tiny_csv),
                                        "run-dir": str(run_dir), "node-wait-s": 60.0, "reply-timeout-s": 30.0,
                                        **relay})
        deadline = time.monotonic() + 240
        while not any(r.get("round") == 1 for r in _records(run_dir)):
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "deploy" / "run.log")
            time.sleep(0.5)
        deployment.kill_node(1)
        assert process.wait(240) == 0, (tmp_path / "deploy" / "run.log").read_text()[-3000:]
    assert "parameters travel on fedlm's relay" in (tmp_path / "deploy" / "run.log").read_text()
    records = read_metrics(run_dir)
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[1]["clients"] == [0, 1]
    assert records[2]["clients"] == [0]
    assert [f["client"] for f in records[2]["failed"]] == [1]
    assert records[2]["failed"][0]["reason"].startswith(("timeout", "node unavailable", "message expired"))
    assert (run_dir / "model").is_dir()


def _records(run_dir) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except Exception:  # a line still being written
        return []


def test_a_killed_server_app_resumes_through_flower_from_its_last_round(tmp_path, tiny_csv, monkeypatch,
                                                                        no_telemetry):
    """The ServerApp dies in round 2; ``resume=true`` with the same run-dir continues from round 1's
    checkpoint and ends with the simulator's model."""
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2)
    raw["partition"]["num_clients"] = 3
    config = validate(raw)
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(dump_config(config))
    settings = {"config": str(config_path), "data-dir": str(tiny_csv), "run-dir": str(tmp_path / "flower")}
    run_single(config, tiny_csv, tmp_path / "sim")

    original = RoundEngine.run_round

    def dies_in_round_two(self, round_idx, global_params):
        if round_idx == 2:
            raise RuntimeError("the ServerApp's machine went down")
        return original(self, round_idx, global_params)

    with monkeypatch.context() as patch:
        patch.setattr(RoundEngine, "run_round", dies_in_round_two)
        with contextlib.suppress(RuntimeError):
            run_through_flower(monkeypatch, 3, **settings)
    assert [r["round"] for r in read_metrics(tmp_path / "flower")] == [0, 1]

    run_through_flower(monkeypatch, 3, **settings, resume=True)
    assert [r["round"] for r in read_metrics(tmp_path / "flower")] == [0, 1, 2]
    assert_saved_classifiers_close(tmp_path / "sim" / "model", tmp_path / "flower" / "model")
