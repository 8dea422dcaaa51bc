"""A round that cannot complete ends the run with one line, a record of why, and a run that resumes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from fedlm.config import validate
from fedlm.errors import RunStopped
from fedlm.federation.executor import ClientFailure
from fedlm.federation.simulation import InProcessExecutor
from fedlm.run.placement import Simulation
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import tiny_config


def test_an_exhausted_round_is_one_line_with_exit_3_and_a_record(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv, rounds=2, max_retries=1)
    raw["train"]["lr"] = 1e38  # every client fails (the optimizer overflows)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "fedlm.cli", "run", str(cfg)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("fedlm: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "round 1: fewer than 1 clients reported after 2 attempts" in lines[0]
    assert "fedlm run --resume" in lines[0]
    last = read_metrics(tmp_path / "runs" / "tiny")[-1]
    assert last["round"] == 1 and last["round_failed"] and last["reported"] == 0 and last["attempts"] == 2
    assert len(last["failed"]) == 8 and last["failed"][-1]["reason"] in lines[0]  # 4 clients x 2 attempts


def test_the_run_resumes_from_the_round_before_the_failed_one(tmp_path, tiny_csv, one_thread):
    config = validate(tiny_config(tmp_path, tiny_csv, rounds=3, max_retries=0))

    class DownInRound2(InProcessExecutor):
        def run(self, jobs):
            if jobs[0].round_idx == 2:
                return [ClientFailure(job.client_id, "exception: RuntimeError: node down") for job in jobs]
            return super().run(jobs)

    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped, match="round 2: fewer than 1 clients reported") as stopped:
        run_single(config, tiny_csv, run_dir, placement=Simulation(DownInRound2))
    assert stopped.value.exit_code == 3
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2]
    run_single(config, tiny_csv, run_dir, resume=True)
    records = read_metrics(run_dir)
    assert [r["round"] for r in records] == [0, 1, 2, 3] and not any(r.get("round_failed") for r in records)

    whole = tmp_path / "whole"
    run_single(config, tiny_csv, whole)
    assert [r["test_accuracy"] for r in read_metrics(whole)] == [r["test_accuracy"] for r in records]


def test_resume_without_a_checkpoint_starts_over_without_a_second_starting_point(tmp_path, tiny_csv, one_thread):
    config = validate(tiny_config(tmp_path, tiny_csv, rounds=1, max_retries=0))

    class DownInRound1(InProcessExecutor):
        def run(self, jobs):
            return [ClientFailure(job.client_id, "exception: RuntimeError: node down") for job in jobs]

    with pytest.raises(RunStopped):
        run_single(config, tiny_csv, tmp_path / "run", placement=Simulation(DownInRound1))
    run_single(config, tiny_csv, tmp_path / "run", resume=True)
    assert [r["round"] for r in read_metrics(tmp_path / "run")] == [0, 1]


def test_resuming_a_run_that_carries_optimizer_state_says_the_state_restarts(tmp_path, tiny_csv, one_thread, caplog):
    raw = tiny_config(tmp_path, tiny_csv, rounds=2, max_retries=0)
    raw["split"] = {"trunk_mode": "sequential", "client_parts": "share", "optimizer_state": "carry"}
    config = validate(raw)
    run_dir = tmp_path / "carry"

    config_1 = config.model_copy(update={"protocol": config.protocol.model_copy(update={"rounds": 1})})
    run_single(config_1, tiny_csv, run_dir)
    with caplog.at_level("WARNING", logger="fedlm"):
        run_single(config, tiny_csv, run_dir, resume=True)
    lines = [r.getMessage() for r in caplog.records if "optimizer_state carry" in r.getMessage()]
    assert len(lines) == 1 and "afresh" in lines[0]
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2]
