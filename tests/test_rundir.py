"""Run directories are kept: a re-run never replaces a run unless told to (and then only once it has loaded),
resume continues only a checkpoint trained with the run's own config, and a config.yaml cut short is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.simulation import InProcessExecutor
from fedlm.run.grid import resume_run, run_config
from fedlm.run.placement import Simulation
from fedlm.run.recorder import read_metrics
from fedlm.run.rundir import END_LINE
from fedlm.run.single import run_single
from tests.conftest import tiny_config


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """Plots are most of a tiny run's time and none of what these tests check."""
    import fedlm.run.single as single

    monkeypatch.setattr(single, "write_partition_report", lambda *args, **kwargs: None)
    monkeypatch.setattr(single, "plot_run", lambda *args, **kwargs: None)


def _raw(tmp_path, tiny_csv, rounds=1):
    raw = tiny_config(tmp_path, tiny_csv, rounds=rounds)
    raw["name"] = "keep"
    raw["partition"] = {"kind": "iid", "num_clients": 2}
    raw["train"]["local_steps"] = 2
    return raw


def _cli(tmp_path, *args):
    proc = subprocess.run([sys.executable, "-m", "fedlm.cli", "run", *map(str, args)], capture_output=True,
                          text=True, cwd=tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("fedlm: ")]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    return proc.returncode, lines[0]


def test_an_output_dir_given_on_the_command_line_holds_the_runs_and_their_cache(tmp_path, tiny_csv, one_thread):
    raw = _raw(tmp_path, tiny_csv)
    elsewhere = tmp_path / "elsewhere"
    run_dir = run_config(validate(raw), tiny_csv, elsewhere)
    assert run_dir == elsewhere / "keep" and (elsewhere / ".cache").is_dir()
    assert not (tmp_path / "runs").exists()  # the config's own output_dir is left alone
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["output_dir"] == str(elsewhere)


def test_a_failed_rerun_leaves_the_finished_run_as_it_was(tmp_path, tiny_csv, one_thread):
    raw = _raw(tmp_path, tiny_csv)
    run_dir = run_config(validate(raw), tiny_csv)
    kept = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(raw))

    rc, line = _cli(tmp_path, cfg, "data.source=/no/such/data")  # a re-run under the same name
    assert rc == 2
    assert f"{run_dir} already holds a finished run" in line and "--overwrite" in line and "name=" in line
    raw["data"]["source"] = "/no/such/data"
    with pytest.raises(UserError, match="/no/such/data"):  # --overwrite: replaced only once data and model load
        run_config(validate(raw), tiny_csv, overwrite=True)
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == kept


def test_overwrite_replaces_the_run_directory_whole(tmp_path, tiny_csv, one_thread):
    raw = _raw(tmp_path, tiny_csv)
    run_dir = run_config(validate(raw), tiny_csv)
    (run_dir / "client_states").mkdir()  # what the earlier run left that the new one would not write
    raw["train"]["lr"] = 0.01
    assert run_config(validate(raw), tiny_csv, overwrite=True) == run_dir
    assert not (run_dir / "client_states").exists()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["lr"] == 0.01
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1]


def test_an_unfinished_run_is_not_restarted_by_accident(tmp_path, tiny_csv, one_thread):
    raw = _raw(tmp_path, tiny_csv, rounds=2)
    config = validate(raw)

    class StopInRound2(InProcessExecutor):
        def run(self, jobs):
            if jobs[0].round_idx == 2:
                raise KeyboardInterrupt
            return super().run(jobs)

    run_dir = tmp_path / "runs" / "keep"
    with pytest.raises(KeyboardInterrupt):
        run_single(config, tiny_csv, run_dir, placement=Simulation(StopInRound2))
    with pytest.raises(UserError, match=f"already holds an unfinished run; continue it with `fedlm run --resume "
                                        f"{run_dir}`"):
        run_config(config, tiny_csv)
    resume_run(run_dir, tiny_csv)
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_resume_refuses_a_checkpoint_trained_with_another_config(tmp_path, tiny_csv, one_thread):
    raw = _raw(tmp_path, tiny_csv)
    run_dir = tmp_path / "run"
    run_single(validate(raw), tiny_csv, run_dir)
    raw["train"]["lr"] = 0.01
    raw["protocol"]["rounds"] = 2
    with pytest.raises(UserError, match=r"state.pt \(round 1\) was trained with another config \(train.lr 0.003 "
                                        r"-> 0.01\)") as err:
        run_single(validate(raw), tiny_csv, run_dir, resume=True)
    assert "\n" not in str(err.value)
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1]  # nothing was touched


def test_rerun_interrupted_before_its_first_checkpoint_never_resumes_the_old_run(tmp_path, tiny_csv, one_thread):
    """The issue's case: run A finished; run B under the same name (--overwrite) is interrupted before it
    checkpoints; --resume must start B over, not continue A's weights."""
    raw = _raw(tmp_path, tiny_csv)
    run_dir = run_config(validate(raw), tiny_csv)
    raw["model"]["overrides"] = {"hidden_dropout_prob": 0.0}

    class StopInRound1(InProcessExecutor):
        def run(self, jobs):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_single(validate(raw), tiny_csv, run_dir, overwrite=True, placement=Simulation(StopInRound1))
    assert not (run_dir / "checkpoint").exists()  # A's checkpoint went with A
    resume_run(run_dir, tiny_csv)
    fresh = tmp_path / "fresh"
    run_single(validate(raw), tiny_csv, fresh)
    strip = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in read_metrics(fresh)]
    assert [{k: v for k, v in r.items() if not k.endswith("_s")} for r in read_metrics(run_dir)] == strip


def test_resume_refuses_a_config_yaml_cut_short(tmp_path, tiny_csv, one_thread):
    raw = _raw(tmp_path, tiny_csv)
    raw["protocol"]["rounds"] = 2
    raw["train"]["lr"] = 0.01  # a default would replace it if the file lost it
    run_dir = tmp_path / "runs" / "keep"
    run_single(validate(raw), tiny_csv, run_dir)
    path = run_dir / "config.yaml"
    text = path.read_text()
    assert text.endswith(END_LINE)
    for cut in (text[: len(text) // 2], text[: -len(END_LINE)]):
        path.write_text(cut)
        with pytest.raises(UserError, match=r"config.yaml is cut short, or was not written by this fedlm") as err:
            resume_run(run_dir, tiny_csv)
        assert "\n" not in str(err.value)
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2]

    def edited(section: str, key: str, value) -> str:
        tree = yaml.safe_load(text)
        tree[section][key] = value
        return yaml.safe_dump(tree, sort_keys=False) + END_LINE

    path.write_text(edited("train", "lr", 0.02))  # whole, but changed where it matters
    with pytest.raises(UserError, match=r"trained with another config \(train.lr 0.01 -> 0.02\)"):
        resume_run(run_dir, tiny_csv)
    path.write_text(edited("protocol", "rounds", 3))  # more rounds: the run continues
    resume_run(run_dir, tiny_csv)
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


def test_resume_reads_a_key_added_since_the_checkpoint_as_its_default(tmp_path, tiny_csv, one_thread):
    """A checkpoint written before fedlm grew a key (here train.lr_schedule, default constant) resumes when the
    run keeps the default, and is refused, naming the key, when the run asks for another value."""
    import torch

    from fedlm.run.checkpoint import FORMAT

    raw = _raw(tmp_path, tiny_csv)
    run_dir = tmp_path / "run"
    run_single(validate(raw), tiny_csv, run_dir)
    path = run_dir / "checkpoint" / "state.pt"
    state = torch.load(path, weights_only=False)
    assert state["format"] == FORMAT
    del state["training_config"]["train.lr_schedule"]  # as an older fedlm wrote it
    state["fingerprint"] = "written-by-an-older-fedlm"
    torch.save(state, path)
    raw["protocol"]["rounds"] = 2
    raw["train"]["lr_schedule"] = "linear"
    with pytest.raises(UserError, match=r"trained with another config \(train.lr_schedule None -> 'linear'\)"):
        run_single(validate(raw), tiny_csv, run_dir, resume=True)
    raw["train"]["lr_schedule"] = "constant"
    run_single(validate(raw), tiny_csv, run_dir, resume=True)
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_a_run_directory_in_use_stops_a_second_process_in_one_line(tmp_path, tiny_csv):
    """While one process holds a run (or a grid), a second run, resume or overwrite of it stops at once naming
    the holder, and leaves the directory as it was; once the holder is gone, the run proceeds."""
    import os

    from fedlm.run.lock import run_lock

    raw = _raw(tmp_path, tiny_csv)
    config = validate(raw)
    run_dir = tmp_path / "runs" / "keep"
    with run_lock(run_dir):  # another process's run, as far as flock can tell (its own open file)
        for attempt in (lambda: run_single(config, tiny_csv, run_dir),
                        lambda: run_single(config, tiny_csv, run_dir, overwrite=True),
                        lambda: run_config(config, tiny_csv, overwrite=True)):
            with pytest.raises(UserError, match=f"in use by another fedlm process \\(pid {os.getpid()}\\)"):
                attempt()
        assert not (run_dir / "metrics.jsonl").exists()
    run_single(config, tiny_csv, run_dir)
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1]

    grid = validate({**raw, "name": "lockgrid", "grid": {"lr": [{"train.lr": 0.01}, {"train.lr": 0.02}]}})
    with run_lock(tmp_path / "runs" / "lockgrid"), pytest.raises(UserError, match="in use"):
        run_config(grid, tiny_csv)


def test_sigterm_stops_a_run_in_one_line_and_it_resumes(tmp_path, tiny_csv, one_thread):
    """A scheduler's stop (SIGTERM) is told as Ctrl-C is: one line naming the run to resume, what it computed kept."""
    import signal
    import time

    raw = _raw(tmp_path, tiny_csv, rounds=500)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "runs" / "keep"
    proc = subprocess.Popen([sys.executable, "-m", "fedlm.cli", "run", "c.yaml"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(read_metrics(run_dir)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    lines = [ln for ln in stderr.splitlines() if ln.startswith("fedlm: ")]
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr
    assert lines == [f"fedlm: stopped by SIGTERM; resume with `fedlm run --resume {run_dir}`"]
    done = read_metrics(run_dir)[-1]["round"]
    assert not list(run_dir.rglob("*.tmp"))
    run_single(validate({**raw, "protocol": {**raw["protocol"], "rounds": done + 1}}), tiny_csv, run_dir, resume=True)
    assert [r["round"] for r in read_metrics(run_dir)] == list(range(done + 2))
