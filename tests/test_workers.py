"""`fedlm run --workers N`: a round's clients spread over processes (torch.distributed, gloo) train what one
process trains, resume whatever the worker count was, and stop in one line when a worker dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedlm.cli import Terminated, main
from fedlm.cli.workers import LAUNCHED_ENV, choose_backend
from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.collective import LOCAL, Collective
from fedlm.federation.executor import ClientFailure, ClientJob
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.observer import RoundObserver
from fedlm.federation.sharded import ShardedExecutor, assign, client_cost
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import ClientStore
from fedlm.run.grid import run_config
from fedlm.run.placement import Sharded
from tests.conftest import tiny_config

# what each run of the grid changes: every strategy family the round loop folds (linear sums, a robust rule under a
# server optimizer, clipped and noised sums, clients' local states, adapters, partial uploads, a masked LM's masks)
METHODS = [
    {"label": "fedavg"},
    {"label": "fedopt", "protocol.kind": "fedopt", "protocol.server_optimizer": "adam", "protocol.server_lr": 0.01,
     "protocol.aggregator": "median"},  # a rule that holds every update: the workers gather them
    {"label": "critical", "sharing.critical_layer": 1, "sharing.local_store": "disk"},  # rank 0 on disk
    {"label": "client-dp", "privacy.kind": "client", "privacy.clip": 0.5, "privacy.noise_multiplier": 0.3},
    {"label": "lora", "adapter": {"kind": "lora", "r": 4, "target_modules": ["query", "value"]},
     "train.lr": 0.01},
    {"label": "ffdapt", "sharing.freeze_window": {"epsilon": 1, "gamma": 1.0}},
    {"label": "mlm", "task": "mlm"},
]


def grid_config(tmp_path: Path, source: Path, name: str, rounds: int = 2, methods: list[dict] = METHODS) -> dict:
    raw = tiny_config(tmp_path, source, rounds=rounds, clients_per_round=5)
    raw.update(name=name, grid={"method": methods})
    raw["partition"] = {"kind": "label_dirichlet", "alpha": 1.0, "num_clients": 6}
    raw["eval"]["local"] = True
    return raw


def fedlm(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fedlm.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_same_runs(one: Path, many: Path, methods: list[dict]) -> None:
    """Every run's metrics (but times) and every saved model tensor equal within 1e-5."""
    runs = sorted(p.parent.relative_to(one) for p in one.rglob("metrics.jsonl"))
    assert len(runs) == len(methods)
    for run in runs:
        mine = [json.loads(line) for line in (one / run / "metrics.jsonl").read_text().splitlines()]
        theirs = [json.loads(line) for line in (many / run / "metrics.jsonl").read_text().splitlines()]
        assert [r["round"] for r in mine] == [r["round"] for r in theirs], run
        for a, b in zip(mine, theirs, strict=True):
            for key in a.keys() - {"wall_s", "train_s"}:
                assert _close(a[key], b[key]), (run, a["round"], key, a[key], b[key])
        weights = sorted(p.relative_to(one / run) for p in (one / run / "model").rglob("*.safetensors"))
        assert weights, run
        for path in weights:
            a, b = load_file(one / run / path), load_file(many / run / path)
            assert a.keys() == b.keys()
            for name in a:
                torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=f"{run}/{path}: {name}")


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= 1e-5 * max(1.0, abs(a))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_two_workers_train_what_one_process_trains_and_resume_across_counts(tmp_path, tiny_csv, one_thread):
    """Every method of the grid, 2 gloo workers against one process: equal within 1e-5. Then runs of 2 rounds
    in one process, continued for a third by 2 processes under torchrun, equal 3 rounds in one process (the
    methods that keep state between rounds: server moments, clients' local parameters, the DP ledger)."""
    single = run_config(validate(grid_config(tmp_path, tiny_csv, "single")), tiny_csv)
    (tmp_path / "two.yaml").write_text(yaml.safe_dump(grid_config(tmp_path, tiny_csv, "two")))
    done = fedlm("run", "two.yaml", "--workers", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_runs(single, tmp_path / "runs" / "two", METHODS)

    stateful = [m for m in METHODS if m["label"] in ("fedopt", "critical", "client-dp")]
    three = run_config(validate(grid_config(tmp_path, tiny_csv, "three", rounds=3, methods=stateful)), tiny_csv)
    resumed = run_config(validate(grid_config(tmp_path, tiny_csv, "resumed", methods=stateful)), tiny_csv)
    for written in [resumed / "grid.yaml", *resumed.rglob("config.yaml")]:
        written.write_text(written.read_text().replace("rounds: 2", "rounds: 3"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                           "-m", "fedlm.cli", "run", "--resume", str(resumed)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_runs(three, resumed, stateful)


def test_a_dead_worker_stops_the_run_in_one_line_and_it_resumes(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, rounds=40, clients_per_round=4)
    raw.update(name="dies", checkpoint_every=1)
    (tmp_path / "dies.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "fedlm.cli", "run", "dies.yaml", "--workers", "2"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs" / "dies" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):  # rounds 0 and 1 recorded
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.2)
    os.kill(_worker_pid(launcher.pid, rank=1), signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    lines = [line for line in stderr.splitlines() if line.startswith("fedlm:")]
    assert len(lines) == 1 and "worker 1 of 2 stopped" in lines[0], stderr[-2000:]
    assert f"--resume {tmp_path / 'runs' / 'dies'} --workers 2" in lines[0]
    recorded = len(metrics.read_text().splitlines())  # rounds 0 .. recorded - 1
    assert recorded < 41  # it stopped early

    written = tmp_path / "runs" / "dies" / "config.yaml"
    written.write_text(written.read_text().replace("rounds: 40", f"rounds: {recorded}"))
    done = fedlm("run", "--resume", str(tmp_path / "runs" / "dies"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["round"] for line in metrics.read_text().splitlines()] == list(range(recorded + 1))


def _worker_pid(launcher: int, rank: int) -> int:
    """The pid of the launcher's child started as ``rank`` (RANK in its environment)."""
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return int(child)
    raise AssertionError(f"no worker of rank {rank} under {launcher}")


def test_jobs_are_balanced_by_cost_and_bad_worker_counts_are_refused(tmp_path, tiny_csv, capsys):
    settings = LocalSettings(lr=0.1, batch_size=8)
    jobs = [ClientJob(cid, 1, None, settings, 0) for cid in range(5)]  # type: ignore[arg-type]
    examples = {0: 40, 1: 1, 2: 24, 3: 17, 4: 8}
    costs = {cid: client_cost(n, settings) for cid, n in examples.items()}
    assert costs == {0: 6, 1: 2, 2: 4, 3: 4, 4: 2}  # batches of 8, plus one for the fixed cost
    owner = assign(jobs, costs, 2)
    loads = [sum(costs[j.client_id] for j, r in zip(jobs, owner, strict=True) if r == rank) for rank in (0, 1)]
    assert owner == [0, 0, 1, 1, 0] and loads == [10, 8]  # 6 | 4; 4 to the lighter; 2 to rank 0; a tie: rank 0
    assert assign(jobs, costs, 9) == [0, 3, 1, 2, 4]  # more workers than clients: some stay idle

    assert main(["run", "x.yaml", "--workers", "0"]) == 2
    assert capsys.readouterr().err.strip() == "fedlm: --workers 0: give 1 or more worker processes"
    # NCCL only where every process of the machine has a GPU of its own; auto falls back to gloo otherwise
    with mock.patch("torch.distributed.is_nccl_available", return_value=True):
        assert [choose_backend("auto", n, gpus) for n, gpus in ((2, 0), (2, 2), (4, 2), (1, 8))] == [
            "gloo", "nccl", "gloo", "nccl"]
        assert choose_backend("gloo", 2, 2) == "gloo"
        with pytest.raises(UserError, match="2 processes here share 1 GPUs"):
            choose_backend("nccl", 2, 1)
    if not torch.cuda.is_available():
        assert main(["run", "x.yaml", "--workers", "2", "--backend", "nccl"]) == 2
        assert capsys.readouterr().err.strip() == ("fedlm: --backend nccl needs a GPU of its own for every process, "
                                                   "but torch sees no GPU: use --backend gloo (or auto)")

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_config(tmp_path, tiny_csv)))
    with mock.patch("fedlm.cli._dispatch", side_effect=KeyboardInterrupt):  # Ctrl-C names the run to resume
        assert main(["run", str(tmp_path / "c.yaml"), "name=stopped"]) == 130
    assert f"--resume {tmp_path / 'runs' / 'stopped'}`" in capsys.readouterr().err
    stopped = ["run", str(tmp_path / "c.yaml"), "name=stopped", "--workers", "2"]
    with mock.patch("fedlm.cli.workers.launch", side_effect=Terminated):  # the launcher speaks for its workers
        assert main(stopped) == 143
    assert capsys.readouterr().err == ("fedlm: stopped by SIGTERM; resume with "
                                       f"`fedlm run --resume {tmp_path / 'runs' / 'stopped'} --workers 2`\n")
    with mock.patch("fedlm.cli._dispatch", side_effect=Terminated), mock.patch.dict(os.environ, {LAUNCHED_ENV: "1"}):
        assert main(stopped[:3]) == 143  # a worker it stopped says nothing
    assert capsys.readouterr().err == ""

    raw = tiny_config(tmp_path, tiny_csv)
    raw["split"] = {"bottom_blocks": 0, "top_blocks": 0}
    with pytest.raises(UserError, match="split learning runs in one process"):
        run_config(validate(raw), tiny_csv, placement=Sharded(LOCAL))



def test_the_leading_process_counts_every_client_of_the_round_as_done():
    """Rank 0 draws the run's progress: the clients the other process trained count as done once its own share is
    (else its step bar stopped at its own share of the round)."""

    class RankZeroOfTwo(Collective):
        world = 2

    class Done(RoundObserver):
        def __init__(self) -> None:
            self.done: list[int] = []

        def client_done(self, client_id: int) -> None:
            self.done.append(client_id)

    class Untrained(InProcessExecutor):  # this process's share, reported as failures instead of training
        def run(self, jobs):
            for job in jobs:
                self.observer.client_done(job.client_id)
                yield ClientFailure(job.client_id, "not trained here")

    settings = LocalSettings(lr=0.1, batch_size=8)
    rows = {cid: [{}] * n for cid, n in enumerate([40, 1, 24, 17, 8])}
    observer = Done()
    inner = Untrained(None, None, rows, None, ClientStore({}), [], observer=observer)  # type: ignore[arg-type]
    jobs = [ClientJob(cid, 1, None, settings, 0) for cid in rows]  # type: ignore[arg-type]
    results = list(ShardedExecutor(inner, RankZeroOfTwo()).run(jobs))
    assert [r.client_id for r in results] == [0, 1, 4]  # its share (test above: owners 0, 0, 1, 1, 0)
    assert observer.done == [0, 1, 4, 2, 3]


@pytest.mark.skipif(any(Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/kfd")), reason="a GPU driver: "
                    "the launcher asks torch how many GPUs there are")
def test_the_launcher_checks_its_workers_without_importing_torch():
    """`fedlm run --workers N` starts its workers at once: on a machine without GPUs its launcher never imports
    torch (seconds of a small job's total, issue 33 item 5)."""
    probe = ("import sys; from fedlm.cli.workers import check_workers, choose_backend; check_workers(2); "
             "assert choose_backend('auto', 2, 0) == 'gloo'; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
