"""What a run shows: bars whose totals are the steps taken, one line per round in a pipe, libraries kept quiet."""

from __future__ import annotations

import json
import logging
import math
import re
import warnings
from typing import ClassVar

import datasets
import huggingface_hub.utils as hub
import numpy as np
import pytest
import torch
import transformers.utils.logging as hf_logging
import yaml
from sklearn.metrics import matthews_corrcoef

from fedlm import metrics
from fedlm.cli import configure_output, main
from fedlm.config import validate
from fedlm.models.build import build_model, build_tokenizer
from fedlm.run import progress as progress_module
from fedlm.run.prepare import prepare
from fedlm.run.progress import RoundProgress
from fedlm.run.single import run_single
from tests.conftest import make_sentences, tiny_config

TQDM_MARKS = ("\r", "%|", "it/s", "step/s", "Loading weights", "Writing model shards")


@pytest.fixture
def output_restored():
    """configure_output sets process-wide state (library verbosity, progress bars, fedlm's level): put it back."""
    saved = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled(),
             datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled(), logging.getLogger("fedlm").level)
    yield
    hf_logging.set_verbosity(saved[0])
    (hf_logging.enable_progress_bar if saved[1] else hf_logging.disable_progress_bar)()
    (hub.disable_progress_bars if saved[2] else hub.enable_progress_bars)()
    datasets.logging.set_verbosity(saved[3])
    (datasets.enable_progress_bars if saved[4] else datasets.disable_progress_bars)()
    logging.getLogger("fedlm").setLevel(saved[5])


class CountingProgress(RoundProgress):
    """Counts the step callbacks, and notes at each round's end what its bar says."""

    made: ClassVar[list[CountingProgress]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heard = 0
        self.rounds_seen: list[dict] = []
        CountingProgress.made.append(self)

    def client_step(self, client_id: int) -> None:
        self.heard += 1
        super().client_step(client_id)

    def round_done(self, record) -> None:
        self.rounds_seen.append({"total": self.steps_bar.total, "n": self.steps_bar.n, "heard": self.heard,
                                 "clients": record.clients})
        self.heard = 0
        super().round_done(record)


def expected_steps(sizes: list[int], clients: list[int], batch_size: int, epochs: int, steps: int | None) -> int:
    """A round's steps computed independently: each client's batches per epoch times its epochs, or its
    fixed number of steps."""
    return sum(steps if steps is not None else epochs * math.ceil(sizes[c] / batch_size) for c in clients)


@pytest.mark.parametrize(("train", "split"), [
    ({"local_epochs": 2}, None),
    ({"local_steps": 5}, None),
    ({}, {"trunk_mode": "sequential", "client_parts": "average", "bottom_blocks": 0, "top_blocks": 0}),
    ({"local_steps": 3}, {"trunk_mode": "client_batch", "client_parts": "share", "bottom_blocks": 1,
                          "top_blocks": 0}),
], ids=["epochs", "steps", "split-sequential", "split-client_batch"])
def test_each_rounds_bar_total_is_the_steps_its_clients_take(tmp_path, tiny_csv, monkeypatch, one_thread, train,
                                                             split):
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=3)
    raw["train"].update(train)
    if split is not None:
        raw["split"] = split
    monkeypatch.setattr(progress_module, "interactive", lambda: True)  # bars on, so they count what they show
    monkeypatch.setattr("fedlm.run.single.RoundProgress", CountingProgress)
    CountingProgress.made.clear()
    run_single(validate(raw), tiny_csv, tmp_path / "run")

    sizes = json.loads((tmp_path / "run" / "data.json").read_text())["client_sizes"]["train"]
    (progress,) = CountingProgress.made
    assert len(progress.rounds_seen) == 2
    for seen in progress.rounds_seen:
        expected = expected_steps(sizes, seen["clients"], 8, train.get("local_epochs", 1), train.get("local_steps"))
        assert len(seen["clients"]) == 3
        assert seen["total"] == seen["heard"] == seen["n"] == expected


def _write_config(tmp_path, tiny_csv, **top) -> str:
    raw = tiny_config(tmp_path, tiny_csv, clients_per_round=2) | top
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_pipe_gets_a_start_line_one_line_per_round_and_no_bars(tmp_path, tiny_csv, capfd, output_restored,
                                                                  one_thread):
    assert main(["run", _write_config(tmp_path, tiny_csv)]) == 0
    out, err = capfd.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("[tiny] fedavg: 2 rounds, 2 of 4 clients per round; writing ")
    rounds = [line for line in lines if re.match(r"\[tiny\] round \d+/2 ", line)]
    assert [line.split()[2] for line in rounds] == ["1/2", "2/2"]
    assert all("train_loss=" in line and "test_accuracy=" in line for line in rounds)
    assert lines[-1].startswith("run directory: ")
    assert not any(mark in out + err for mark in TQDM_MARKS)
    assert "Warning" not in err and "LOAD REPORT" not in err


def _tiny_checkpoint(tmp_path):
    """A tiny BERT encoder without any task head, saved as a checkpoint, and its tokenizer."""
    tokenizer = build_tokenizer(None, "bert", [text for text, _ in make_sentences(60)], 200)
    model = build_model("bert", "tiny", "classification", tokenizer, num_labels=2)
    model.bert.save_pretrained(tmp_path / "encoder")
    return tokenizer, str(tmp_path / "encoder")


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_new_head_is_one_fedlm_line_and_the_load_report_only_shows_with_verbose(tmp_path, caplog, capfd,
                                                                                 output_restored):
    tokenizer, checkpoint = _tiny_checkpoint(tmp_path)
    transformers_log = Kept()
    logging.getLogger("transformers").addHandler(transformers_log)
    try:
        configure_output(verbose=False)
        capfd.readouterr()  # what saving the checkpoint printed
        with caplog.at_level(logging.INFO, logger="fedlm"):
            build_model("bert", None, "classification", tokenizer, num_labels=2, checkpoint=checkpoint)
        fedlm_lines = [r.getMessage() for r in caplog.records if r.name == "fedlm"]
        assert fedlm_lines == ["new classification head initialised: classifier.weight, classifier.bias"]
        assert not any("LOAD REPORT" in m for m in transformers_log.messages)
        assert not any(mark in capfd.readouterr().err for mark in TQDM_MARKS)

        configure_output(verbose=True)
        build_model("bert", None, "classification", tokenizer, num_labels=2, checkpoint=checkpoint)
        assert any("LOAD REPORT" in m for m in transformers_log.messages)
    finally:
        logging.getLogger("transformers").removeHandler(transformers_log)


def test_a_complete_checkpoint_says_nothing(tmp_path, caplog):
    tokenizer, checkpoint = _tiny_checkpoint(tmp_path)
    build_model("bert", None, "classification", tokenizer, num_labels=2, checkpoint=checkpoint).save_pretrained(
        tmp_path / "classifier")
    caplog.clear()  # the line above said "new head" (heard when an earlier CLI test left fedlm's logger at INFO)
    with caplog.at_level(logging.INFO, logger="fedlm"):
        build_model("bert", None, "classification", tokenizer, num_labels=2, checkpoint=str(tmp_path / "classifier"))
    assert not [r for r in caplog.records if r.name == "fedlm"]


def test_one_class_scores_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert metrics.mcc(np.array([1, 1, 1]), np.array([1, 1, 1])) == 0.0
        preds, labels = np.array([0, 1, 1, 0]), np.array([1, 0, 1, 0])
        assert metrics.mcc(preds, labels) == pytest.approx(matthews_corrcoef(labels, preds))


def test_evaluation_reports_each_batch_of_each_data_set(tmp_path, tiny_csv):
    prep = prepare(validate(tiny_config(tmp_path, tiny_csv)), tiny_csv)
    heard: list[tuple[int, int]] = []
    scores = prep.task.evaluate(prep.model, prep.test_rows, 16, torch.Generator().manual_seed(0),
                                on_batch=lambda done, batches: heard.append((done, batches)))
    assert len(prep.test_rows) == 40
    assert heard == [(1, 3), (2, 3), (3, 3)]
    assert scores == prep.task.evaluate(prep.model, prep.test_rows, 16, torch.Generator().manual_seed(0))
