"""A round that cannot complete ends the run with one line, a record of why, and a run that resumes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from fedlm.cli.commands import report_runs
from fedlm.config import validate
from fedlm.errors import RunStopped
from fedlm.federation.executor import ClientFailure, ClientReport
from fedlm.federation.simulation import InProcessExecutor
from fedlm.run.environment import environment_note
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


def test_a_run_records_its_environment_and_a_resume_on_other_threads_says_so(tmp_path, tiny_csv, one_thread, caplog):
    # the thread count changes the order of float reductions: same code and seed, other numbers (fedbert.md)
    config = validate(tiny_config(tmp_path, tiny_csv, rounds=3, max_retries=0))
    run_dir = tmp_path / "run"
    run_single(config.model_copy(update={"protocol": config.protocol.model_copy(update={"rounds": 1})}),
               tiny_csv, run_dir)
    with caplog.at_level("WARNING", logger="fedlm"):
        run_single(config.model_copy(update={"protocol": config.protocol.model_copy(update={"rounds": 2})}),
                   tiny_csv, run_dir, resume=True)  # same ground: nothing said
        torch.set_num_threads(2)
        run_single(config, tiny_csv, run_dir, resume=True)
    lines = [r.getMessage() for r in caplog.records if "environment" in r.getMessage()]
    assert len(lines) == 1 and "resumed at round 3" in lines[0] and "threads 1 -> 2" in lines[0], lines
    stretches = json.loads((run_dir / "environment.json").read_text())["stretches"]
    assert [(s["from_round"], s["threads"]) for s in stretches] == [(1, 1), (2, 1), (3, 2)]
    assert stretches[0]["torch"] == torch.__version__ and stretches[0]["device"] == "cpu"
    assert stretches[0]["processes"] == 1
    # a comparison over runs on different ground says so, naming what differs; one on the same ground does not
    assert "threads: 1, 2" in report_runs([run_dir])
    assert environment_note([run_dir]).startswith("Note: these runs ran on different environments")
    assert environment_note([tmp_path / "nothing recorded"]) == ""


def _scaling(client_id: int, factor: float, rounds: tuple[int, ...] = (1,)) -> type[InProcessExecutor]:
    """A simulator in which ``client_id`` reports its parameters times ``factor`` in ``rounds`` (an attack)."""

    class Scaling(InProcessExecutor):
        def run(self, jobs):
            for result in super().run(jobs):
                if isinstance(result, ClientReport) and result.update.client_id == client_id \
                        and jobs[0].round_idx in rounds:
                    result.update.params = {n: t * factor for n, t in result.update.params.items()}
                yield result

    return Scaling


def _failing(client_id: int, round_idx: int) -> type[InProcessExecutor]:
    class Failing(InProcessExecutor):
        def run(self, jobs):
            for result in super().run(jobs):
                if isinstance(result, ClientReport) and result.update.client_id == client_id \
                        and jobs[0].round_idx == round_idx:
                    result = ClientFailure(client_id, "exception: left out")
                yield result

    return Failing


def test_a_client_that_scales_its_parameters_is_refused_by_name_and_the_run_goes_on(tmp_path, tiny_csv, one_thread):
    config = validate(tiny_config(tmp_path, tiny_csv, rounds=3, max_retries=0))
    attacked, clean = tmp_path / "attacked", tmp_path / "clean"
    run_single(config, tiny_csv, attacked, placement=Simulation(_scaling(2, 1e6)))
    records = read_metrics(attacked)
    assert [r["round"] for r in records] == [0, 1, 2, 3] and not any(r.get("round_failed") for r in records)
    (refused,) = records[1]["failed"]
    assert refused["client"] == 2 and refused["reason"].startswith("update refused: its tensor ")
    assert "e+06x the global model's scale (protocol.max_update_growth: 1000)" in refused["reason"]
    assert 2 not in records[1]["clients"] and records[2]["failed"] == []
    # what the round committed is what it would have been had client 2 simply dropped out
    run_single(config, tiny_csv, clean, placement=Simulation(_failing(2, 1)))
    assert [r["test_accuracy"] for r in read_metrics(clean)] == [r["test_accuracy"] for r in records]
    resumed = torch.load(attacked / "checkpoint" / "state.pt", weights_only=False)["global"]
    assert all(torch.equal(resumed[n], t) for n, t in
               torch.load(clean / "checkpoint" / "state.pt", weights_only=False)["global"].items())


def test_with_the_screen_off_the_failed_round_names_the_client_whose_update_poisoned_it(tmp_path, tiny_csv,
                                                                                      one_thread):
    raw = tiny_config(tmp_path, tiny_csv, rounds=3, max_retries=1, max_update_growth=None)
    raw["partition"]["num_clients"] = 2
    config = validate(raw)
    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped, match="round 2: fewer than 1 clients reported") as stopped:
        run_single(config, tiny_csv, run_dir, placement=Simulation(_scaling(1, 1e12)))
    assert "whose largest update was client 1's" in str(stopped.value)
    failed = read_metrics(run_dir)[-1]
    assert failed["round_failed"] and all(f["reason"].startswith("non-finite update") for f in failed["failed"])
    assert failed["suspect"]["round"] == 1 and failed["suspect"]["client"] == 1
    assert failed["suspect"]["growth"] > 1e10


def test_an_error_no_retry_can_fix_stops_the_run_at_once_in_one_line(tmp_path, tiny_csv, one_thread):
    """Every client raising the same TypeError is the code's or the model's failure, not theirs: no retries."""
    from fedlm.federation.client_round import client_failure

    config = validate(tiny_config(tmp_path, tiny_csv, rounds=2, max_retries=2))
    tries = []

    class Unsupported(InProcessExecutor):
        def run(self, jobs):
            tries.append(jobs[0].round_idx)
            if jobs[0].round_idx == 2:
                missing = TypeError("DecoderLayer.forward() missing 1 required positional argument: 'alibi'")
                return [client_failure(job.client_id, missing) for job in jobs]
            return super().run(jobs)

    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped, match="round 2: every client failed with an error no retry can fix") as stopped:
        run_single(config, tiny_csv, run_dir, placement=Simulation(Unsupported))
    assert "TypeError: DecoderLayer.forward() missing" in str(stopped.value) and "--resume" not in str(stopped.value)
    assert tries == [1, 2]  # round 2 tried once, not three times
    failed = read_metrics(run_dir)[-1]
    assert failed["round_failed"] and failed["attempts"] == 1 and len(failed["failed"]) == 4
