"""Test helpers that drive training end to end: a few plain optimizer steps, a run taken two ways whose final
weights must agree, a run stopped at a chosen round as a crash would stop it, and the CLI in a fresh process.

Several task and adapter tests check the same equivalences (one FedAvg client is centralized training; a
one-client split run is FedAvg), so the procedure lives here once and each test keeps its own configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from fedlm.config import validate
from fedlm.federation.simulation import InProcessExecutor
from fedlm.run.placement import Simulation
from fedlm.run.recorder import RunRecorder, read_metrics
from fedlm.run.single import run_single
from fedlm.tasks import Task
from tests.conftest import tiny_config


def central_steps(task: Task, model: torch.nn.Module, batch: dict, steps: int = 15,
                  lr: float = 3e-3) -> tuple[list[float], int]:
    """``steps`` AdamW steps of ``model`` on one batch: every step's loss, and the last step's count."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, count = [], 0
    for _ in range(steps):
        loss, count = task.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, count


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The global weights a finished run checkpointed."""
    return RunRecorder(run_dir).load_checkpoint()["global"]


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 0.0,
                        atol: float = 1e-6) -> None:
    """The same tensor names, and every tensor equal within the tolerances."""
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=name)


def assert_saved_classifiers_close(a_dir: Path, b_dir: Path, atol: float = 1e-6) -> None:
    """The sequence classifiers two runs saved (``RUN_DIR / "model"``) have the same parameters within ``atol``."""
    a = AutoModelForSequenceClassification.from_pretrained(a_dir)
    b = AutoModelForSequenceClassification.from_pretrained(b_dir)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=atol), name


def one_client_fedavg_equals_centralized(config_for: Callable[[str], object], data_dir: Path,
                                         tmp_path: Path) -> dict[str, list[dict]]:
    """Runs ``config_for("fedavg")`` and ``config_for("centralized")`` (validated configs, one client) into
    ``tmp_path / kind``; asserts both end with the same weights (atol 1e-6); returns each run's records."""
    for kind in ("fedavg", "centralized"):
        run_single(config_for(kind), data_dir, tmp_path / kind)
    assert_same_weights(final_weights(tmp_path / "fedavg"), final_weights(tmp_path / "centralized"))
    return {kind: read_metrics(tmp_path / kind) for kind in ("fedavg", "centralized")}


def one_client_split_equals_fedavg(tmp_path: Path, source: Path, adapter: dict) -> dict[str, torch.Tensor]:
    """The tiny BERT (3 blocks) with ``adapter``, one client: FedAvg, then split at (1, 1) with the client's
    parts averaged, into ``tmp_path / "fedavg"`` and ``/ "split"``; asserts both end with the same weights and
    returns the split run's."""
    raw = tiny_config(tmp_path, source)
    raw["partition"] = {"kind": "iid", "num_clients": 1}
    raw["model"]["overrides"] = {"hidden_dropout_prob": 0.1, "num_hidden_layers": 3}
    raw["train"]["max_grad_norm"] = None  # the split clips client and trunk separately, FedAvg jointly
    raw["adapter"] = adapter
    run_single(validate(raw), source, tmp_path / "fedavg")
    raw["split"] = {"bottom_blocks": 1, "top_blocks": 1, "client_parts": "average"}
    run_single(validate(raw), source, tmp_path / "split")
    got = final_weights(tmp_path / "split")
    assert_same_weights(got, final_weights(tmp_path / "fedavg"), rtol=1e-4, atol=2e-5)
    return got


class Interrupt(Exception):
    """What :func:`stop_at_round`'s executor raises: a crash at a known round."""


def stop_at_round(round_idx: int) -> type[InProcessExecutor]:
    """An in-process executor that raises :class:`Interrupt` when round ``round_idx`` starts its clients."""

    class StopAtRound(InProcessExecutor):
        def run(self, jobs):
            if jobs[0].round_idx == round_idx:
                raise Interrupt
            return super().run(jobs)

    return StopAtRound


def run_until_interrupted(config, source: Path, run_dir: Path, round_idx: int) -> None:
    """Runs ``config`` into ``run_dir`` until round ``round_idx`` crashes (asserted): what a resume picks up."""
    with pytest.raises(Interrupt):
        run_single(config, source, run_dir, placement=Simulation(stop_at_round(round_idx)))


def cli_run(raw: dict, config_path: Path, data_dir: Path) -> None:
    """``fedlm --data-dir DATA run CONFIG`` in a fresh interpreter on ``raw`` written to ``config_path``; asserts
    it exits 0."""
    config_path.write_text(json.dumps(raw))
    proc = subprocess.run([sys.executable, "-m", "fedlm.cli", "--data-dir", str(data_dir), "run", str(config_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
