"""Validation splits and eval.select: best (issue 36 items 4-5: model and learning-rate choice on held-out data,
never on the test split): the held-out share, the round chosen, the model delivered, and the refusals."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.run.prepare import load_data
from fedlm.run.recorder import read_metrics
from fedlm.run.report import summarize
from fedlm.run.selection import BestOnValidation
from fedlm.run.single import run_single
from tests.conftest import tiny_config
from tests.training_helpers import run_until_interrupted


def _config(tmp_path, source, **evaluation):
    raw = tiny_config(tmp_path, source)
    raw["data"]["validation_fraction"] = 0.25
    raw["eval"].update(evaluation)
    return raw


def test_the_validation_share_is_held_out_of_training_with_the_seed(tmp_path, tiny_csv):
    loaded = load_data(validate(_config(tmp_path, tiny_csv)), tiny_csv)
    train, held = loaded.splits["train"]["text"][:], loaded.splits["validation"]["text"][:]
    assert (len(train), len(held)) == (90, 30)  # 120 sentences, a quarter held out
    whole = load_data(validate(tiny_config(tmp_path, tiny_csv)), tiny_csv)
    assert sorted(train + held) == sorted(whole.splits["train"]["text"][:]) and "validation" not in whole.splits
    assert load_data(validate(_config(tmp_path, tiny_csv)), tiny_csv).splits["validation"]["text"][:] == held
    assert loaded.fingerprint != whole.fingerprint  # partitions of the smaller training split are cached apart


def test_a_best_round_is_chosen_by_validation_and_its_test_score_is_the_final_one():
    records = [{"round": 0, "val_accuracy": 0.5, "test_accuracy": 0.50},
               {"round": 1, "val_accuracy": 0.7, "test_accuracy": 0.60},
               {"round": 2, "val_accuracy": 0.6, "test_accuracy": 0.75},
               {"round": 3, "val_accuracy": 0.7, "test_accuracy": 0.80}]
    best = summarize(records, "accuracy", "max", select="best")
    assert (best["selected round"], best["val accuracy"], best["final accuracy"]) == (1, 0.7, 0.60)  # first of equals
    last = summarize(records, "accuracy", "max")
    assert (last["final accuracy"], last["val accuracy"]) == (0.80, 0.7) and "selected round" not in last
    loss = [{"round": r, "val_loss": v, "test_loss": t} for r, v, t in ((0, 2.0, 2.1), (1, 1.5, 1.4), (2, 1.6, 1.2))]
    assert summarize(loss, "loss", "min", select="best")["final loss"] == 1.4


def test_the_keeper_saves_the_best_rounds_parameters_and_a_resumed_run_keeps_its_best(tmp_path):
    path = tmp_path / "checkpoint" / "best.safetensors"
    keeper = BestOnValidation(path, "accuracy", "max", [])
    for round_idx, value in enumerate([0.5, 0.7, 0.6, 0.7, float("nan")]):
        keeper.observe(round_idx, {"w": torch.full((2,), float(round_idx))}, value)
    assert load_file(path)["w"].tolist() == [1.0, 1.0]  # round 1: the first 0.7
    resumed = BestOnValidation(path, "accuracy", "max", [{"round": 1, "val_accuracy": 0.7}])
    resumed.observe(2, {"w": torch.full((2,), 2.0)}, 0.65)
    assert resumed.params({"w": torch.zeros(2)})["w"].tolist() == [1.0, 1.0]
    resumed.observe(3, {"w": torch.full((2,), 3.0)}, 0.9)
    assert resumed.params({"w": torch.zeros(2)})["w"].tolist() == [3.0, 3.0]
    BestOnValidation(path, "accuracy", "max", [])  # a new run in the same place forgets an earlier attempt's best
    assert not path.exists()


def test_a_run_scores_validation_every_round_and_delivers_the_selected_model(tmp_path, tiny_csv, one_thread):
    raw = _config(tmp_path, tiny_csv, select="best")
    raw["protocol"]["rounds"] = 3
    raw["train"]["lr"] = 0.05  # too hot: validation peaks at round 1 and falls, so the best is not the last
    run_dir = tmp_path / "run"
    row = run_single(validate(raw), tiny_csv, run_dir)
    records = read_metrics(run_dir)
    assert all("val_accuracy" in r and "test_accuracy" in r for r in records)
    values = [r["val_accuracy"] for r in records]
    chosen = values.index(max(values))
    assert row["selected round"] == chosen < 3 and row["final accuracy"] == records[chosen]["test_accuracy"]
    last = torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)["global"]
    best = load_file(run_dir / "checkpoint" / "best.safetensors")
    saved = AutoModelForSequenceClassification.from_pretrained(run_dir / "model").state_dict()
    for name, value in best.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert any(not torch.equal(best[name], last[name]) for name in best)  # the delivered model is not the last


def test_validation_refusals_name_the_fix(tmp_path, tiny_csv):
    raw = tiny_config(tmp_path, tiny_csv)
    raw["eval"]["select"] = "best"
    with pytest.raises(UserError, match=r"set data\.validation_fraction"):
        load_data(validate(raw), tiny_csv)
    own = tmp_path / "with-dev"
    shutil.copytree(tiny_csv, own)
    shutil.copy(own / "test.csv", own / "dev.csv")  # a source with a validation split of its own
    with_dev = validate({**raw, "data": {**raw["data"], "source": str(own)}})
    assert len(load_data(with_dev, own).splits["validation"]) == 40  # its own, scored under select best
    with pytest.raises(UserError, match=r"remove data\.validation_fraction"):
        load_data(validate(_config(tmp_path, own)), own)
    with pytest.raises(UserError, match=r"less than or equal"):
        raw["data"]["validation_fraction"] = 0.9
        validate(raw)
    personal = _config(tmp_path, tiny_csv, select="best")
    personal["sharing"] = {"critical_layer": 1}
    with pytest.raises(UserError, match=r"eval\.select: best picks one global model"):
        run_single(validate(personal), tiny_csv, tmp_path / "personal")
    assert not (tmp_path / "personal" / "config.yaml").exists()  # refused before the run directory is written


def test_a_resumed_run_delivers_the_same_selected_model(tmp_path, tiny_csv, one_thread):
    """The best round (1) was evaluated before the crash (at round 3): the resumed run still delivers it."""
    raw = _config(tmp_path, tiny_csv, select="best")
    raw["protocol"]["rounds"] = 3
    raw["train"]["lr"] = 0.05
    whole = run_single(validate(raw), tiny_csv, tmp_path / "whole")
    run_until_interrupted(validate(raw), tiny_csv, tmp_path / "cut", 3)
    resumed = run_single(validate(raw), tiny_csv, tmp_path / "cut", resume=True)
    assert resumed["selected round"] == whole["selected round"] == 1
    assert resumed["final accuracy"] == whole["final accuracy"]
    kept = [load_file(tmp_path / run / "checkpoint" / "best.safetensors") for run in ("whole", "cut")]
    for name, value in kept[0].items():
        torch.testing.assert_close(kept[1][name], value, rtol=0, atol=0)
