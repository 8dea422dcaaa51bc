"""report_to: every round record of metrics.jsonl as TensorBoard scalars (per run, grids side by side, resumes
shown once), W&B when installed, one clear line when a tracker's package is missing."""

from __future__ import annotations

import math
import sys
import types

import pytest
import yaml

from fedlm.cli import main
from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.run.grid import run_config
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from fedlm.run.tracking import WANDB_ID, open_trackers, scalars
from tests.conftest import tiny_config
from tests.training_helpers import run_until_interrupted


def test_scalars_are_the_records_numbers_with_nested_keys_joined():
    record = {"round": 3, "train_loss": 0.5, "clients": [0, 2], "failed": [{"client": 1, "reason": "x"}],
              "test_accuracy": float("nan"), "local_accuracy_mean": None, "bytes_up": 10, "flag": True,
              "bytes_by_client": {"0": {"up": 4, "down": 6}}, "test_by_client": {"2": {"accuracy": 0.75}}}
    assert scalars(record) == {"train_loss": 0.5, "bytes_up": 10.0, "bytes_by_client/0/up": 4.0,
                               "bytes_by_client/0/down": 6.0, "test_by_client/2/accuracy": 0.75}


def read_tensorboard(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run's TensorBoard directory as tag -> [(step, value)], as TensorBoard would show it."""
    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    accumulator = accumulator_module.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def expected_from_metrics(run_dir) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl read independently: every number per round, nested mappings joined with '/'."""
    expected: dict[str, list[tuple[int, float]]] = {}

    def walk(step: int, prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(step, f"{prefix}/{key}" if prefix else key, inner)
        elif isinstance(value, int | float) and not isinstance(value, bool) and prefix != "round":
            expected.setdefault(prefix, []).append((step, float(value)))

    for record in read_metrics(run_dir):
        walk(record["round"], "", record)
    return expected


def assert_same(shown: dict, expected: dict) -> None:
    assert shown.keys() == expected.keys()
    for tag, points in expected.items():
        assert [step for step, _ in shown[tag]] == [step for step, _ in points], tag
        for (_, got), (_, want) in zip(shown[tag], points, strict=True):
            assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9), tag


def test_grid_runs_write_their_metrics_side_by_side(tmp_path, tiny_csv, one_thread):
    pytest.importorskip("tensorboard")
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2) | {"report_to": ["tensorboard"],
                                                                  "grid": {"train.lr": [0.003, 0.001]}}
    root = run_config(validate(raw), tiny_csv)
    runs = sorted(p.parent for p in root.glob("*/tensorboard"))
    assert [p.name for p in runs] == ["lr=0.001", "lr=0.003"]
    assert not (root / "tensorboard").exists()
    for run_dir in runs:
        shown = read_tensorboard(run_dir)
        assert_same(shown, expected_from_metrics(run_dir))
        assert [step for step, _ in shown["test_accuracy"]] == [0, 1, 2]
        assert [step for step, _ in shown["train_loss"]] == [1, 2]
        assert "local_by_client/0/accuracy" in shown or "local_by_client/1/accuracy" in shown


def test_a_resumed_run_shows_each_round_once(tmp_path, tiny_csv, one_thread):
    pytest.importorskip("tensorboard")
    raw = tiny_config(tmp_path, tiny_csv, rounds=4, clients_per_round=2) | {"report_to": ["tensorboard"],
                                                                           "checkpoint_every": 2}
    config = validate(raw)

    run_dir = tmp_path / "run"
    run_until_interrupted(config, tiny_csv, run_dir, round_idx=4)
    assert [step for step, _ in read_tensorboard(run_dir)["test_accuracy"]] == [0, 1, 2, 3]  # 3: not checkpointed
    run_single(config, tiny_csv, run_dir, resume=True)
    assert [r["round"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    shown = read_tensorboard(run_dir)
    assert_same(shown, expected_from_metrics(run_dir))
    assert [step for step, _ in shown["test_accuracy"]] == [0, 1, 2, 3, 4]


def _config_file(tmp_path, tiny_csv, report_to: list[str]) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, tiny_csv) | {"report_to": report_to}))
    return str(path)


@pytest.mark.parametrize(("tracker", "module", "install"), [
    ("wandb", "wandb", "pip install wandb"),
    ("tensorboard", "torch.utils.tensorboard", "pip install 'fedlm[tracking]'"),
])
def test_a_missing_tracker_is_one_clear_line_before_the_run_starts(tmp_path, tiny_csv, capsys, monkeypatch,
                                                                   tracker, module, install):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if the package were not installed
    assert main(["run", _config_file(tmp_path, tiny_csv, [tracker])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedlm: report_to: {tracker} needs the {tracker} package: {install}"]
    assert not (tmp_path / "runs").exists()


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records the runs started and what they were given."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.runs: list[FakeRun] = []

    def init(self, **kwargs) -> FakeRun:
        self.runs.append(FakeRun(kwargs))
        return self.runs[-1]


class FakeRun:
    def __init__(self, kwargs: dict) -> None:
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished = True


def test_wandb_gets_one_run_per_fedlm_run_continued_on_resume(tmp_path, tiny_csv, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = validate(tiny_config(tmp_path, tiny_csv) | {"report_to": ["wandb"]})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"round": 0, "test_accuracy": 0.5, "clients": []}, {"round": 1, "train_loss": 0.7}]
    for resume, logged in ((False, records), (True, records[1:])):
        trackers = open_trackers(config, run_dir, resume)
        for record in logged:
            trackers.log(record)
        trackers.close()
    first, resumed = fake.runs
    assert first.kwargs["id"] == resumed.kwargs["id"] == (run_dir / WANDB_ID).read_text()
    assert first.kwargs["resume"] == "allow" and first.kwargs["name"] == "tiny"
    assert first.kwargs["config"]["protocol"]["kind"] == "fedavg"
    assert first.logged == [(0, {"test_accuracy": 0.5}), (1, {"train_loss": 0.7})]
    assert resumed.logged == [(1, {"train_loss": 0.7})]
    assert first.finished and resumed.finished


def test_an_unknown_tracker_is_a_config_error(tmp_path, tiny_csv):
    with pytest.raises(UserError, match="report_to"):
        validate(tiny_config(tmp_path, tiny_csv) | {"report_to": ["mlflow"]})
