"""Checkpoints are crash-consistent: a run killed at any step inside checkpointing resumes to the very run an
uninterrupted one gives (bitwise), and resuming refuses a checkpoint whose client states do not fit."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fedlm.run.single as single
from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.run.recorder import RunRecorder, read_metrics
from fedlm.run.single import run_single
from tests.conftest import tiny_config

CRASH_ROUND = 2


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """Plots are most of a tiny run's time and no part of what is resumed; these tests run dozens of runs."""
    monkeypatch.setattr(single, "write_partition_report", lambda *args, **kwargs: None)
    monkeypatch.setattr(single, "plot_run", lambda *args, **kwargs: None)


class Killed(BaseException):  # kill -9: no `except Exception` in fedlm may catch it
    """The process dies here."""


class Faults:
    """Counts every file mutation (write, fsync, rename, delete) made while the run checkpoints round
    ``CRASH_ROUND`` and kills the run at the ``at``-th; a killed ``torch.save`` leaves half a file behind."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int | None) -> None:
        self.at, self.count, self.active = at, 0, False
        real_save = torch.save
        for name in ("replace", "rename", "unlink", "fsync"):
            monkeypatch.setattr(os, name, self._counted(getattr(os, name)))

        def torn_save(obj, f, *args, **kwargs):
            if self._step():
                buf = io.BytesIO()
                real_save(obj, buf, *args, **kwargs)
                half = buf.getvalue()[: len(buf.getvalue()) // 2]
                if isinstance(f, str | Path):
                    Path(f).write_bytes(half)
                else:
                    f.write(half)
                raise Killed
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", torn_save)
        real_checkpointer = single.checkpointer

        def checkpointer(*args, **kwargs):
            save = real_checkpointer(*args, **kwargs)

            def hooked(round_idx, params):
                self.active = round_idx == CRASH_ROUND
                try:
                    save(round_idx, params)
                finally:
                    self.active = False

            return hooked

        monkeypatch.setattr(single, "checkpointer", checkpointer)

    def _step(self) -> bool:
        if not self.active:
            return False
        self.count += 1
        return self.count == self.at

    def _counted(self, fn):
        def wrapped(*args, **kwargs):
            if self._step():
                raise Killed
            return fn(*args, **kwargs)

        return wrapped


def _config(tmp_path, tiny_csv, **sections):
    raw = tiny_config(tmp_path, tiny_csv, rounds=CRASH_ROUND)
    raw["partition"] = {"kind": "iid", "num_clients": 3}
    raw["train"]["local_steps"] = 2
    raw.update(sections)
    return validate(raw)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every saved model (personalised runs: one per client), keyed by file and name."""
    return {f"{path.relative_to(run_dir)}:{name}": tensor
            for path in sorted((run_dir / "model").rglob("*.safetensors")) for name, tensor in load_file(path).items()}


def _metrics(run_dir: Path) -> list[dict]:
    """The records without timings (seconds differ between any two runs)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in read_metrics(run_dir)]


CASES = {
    "critical_layer": {"sharing": {"critical_layer": 1}},
    "critical_layer_disk": {"sharing": {"critical_layer": 1, "local_store": "disk"}},
    "split_average_bottom": {"split": {"trunk_mode": "sequential", "client_parts": "average_bottom"}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_crash_at_any_step_of_a_checkpoint_resumes_to_the_uninterrupted_run(case, tmp_path, tiny_csv, one_thread):
    config = _config(tmp_path, tiny_csv, **CASES[case])
    whole = tmp_path / "whole"
    with pytest.MonkeyPatch.context() as mp:
        counter = Faults(mp, at=None)
        run_single(config, tiny_csv, whole)
    steps = counter.count
    assert steps >= 4  # at least: the checkpoint file's write, fsync and rename, and its directory's fsync
    expected_weights, expected_metrics = _weights(whole), _metrics(whole)
    assert expected_weights
    for at in range(1, steps + 1):
        cut = tmp_path / f"cut{at}"
        with pytest.MonkeyPatch.context() as mp:
            Faults(mp, at=at)
            with pytest.raises(Killed):
                run_single(config, tiny_csv, cut)
        run_single(config, tiny_csv, cut, resume=True)
        assert _metrics(cut) == expected_metrics, f"killed at step {at} of {steps}"
        got = _weights(cut)
        assert got.keys() == expected_weights.keys()
        for key, tensor in expected_weights.items():
            assert torch.equal(got[key], tensor), f"killed at step {at} of {steps}: {key}"


def test_resume_refuses_a_disk_store_missing_a_file_its_checkpoint_names(tmp_path, tiny_csv, one_thread):
    config = _config(tmp_path, tiny_csv, sharing={"critical_layer": 1, "local_store": "disk"})
    run_dir = tmp_path / "run"
    run_single(config, tiny_csv, run_dir)
    committed = sorted((run_dir / "client_states" / "committed").glob("*.pt"))
    assert [p.name.split(".")[1] for p in committed] == ["r2"] * 3  # one version per client, older ones dropped
    committed[0].unlink()
    with pytest.raises(UserError, match=r"needs client 0's local state .*0\.r2\.pt, which is missing") as err:
        run_single(config, tiny_csv, run_dir, resume=True)
    assert "\n" not in str(err.value)


def test_resume_refuses_a_damaged_checkpoint_file_in_one_line(tmp_path, tiny_csv, one_thread):
    config = _config(tmp_path, tiny_csv)
    run_dir = tmp_path / "run"
    run_single(config, tiny_csv, run_dir)
    state = run_dir / "checkpoint" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    with pytest.raises(UserError, match=r"state\.pt cannot be read .*the checkpoint is damaged"):
        run_single(config, tiny_csv, run_dir, resume=True)


def test_a_record_torn_by_a_crash_while_appended_is_dropped_on_resume(tmp_path, tiny_csv, one_thread):
    config = _config(tmp_path, tiny_csv)
    run_single(config, tiny_csv, tmp_path / "whole")
    real_log = RunRecorder.log_round

    def torn_log(self, record):
        if record.round != CRASH_ROUND:
            return real_log(self, record)
        with self.metrics_path.open("a") as fh:
            fh.write('{"round": 2, "train_lo')
        raise Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunRecorder, "log_round", torn_log)
        with pytest.raises(Killed):
            run_single(config, tiny_csv, tmp_path / "cut")
    run_single(config, tiny_csv, tmp_path / "cut", resume=True)
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "whole")
    got, expected = _weights(tmp_path / "cut"), _weights(tmp_path / "whole")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_checkpoint_write_the_disk_refuses_leaves_the_old_one_and_no_temporary_file(tmp_path, monkeypatch):
    import errno

    from fedlm.federation.durable import save_atomic

    path = tmp_path / "state.pt"
    save_atomic({"round": 1}, path)

    def full(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match="No space left"):
        save_atomic({"round": 2}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]
    assert torch.load(path, weights_only=False) == {"round": 1}
