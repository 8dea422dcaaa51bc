"""Fine-tuning a run's saved model on other tasks (FDAPT and FedBERT judge pre-training this way)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from fedlm.config import ExperimentConfig, downstream_config
from fedlm.run.recorder import finished, read_metrics, slug
from fedlm.run.report import summarize
from fedlm.tasks import get_task

log = logging.getLogger("fedlm")
RunOne = Callable[..., dict[str, Any]]  # run_single's signature: (config, data_dir, run_dir, resume=...)


def run_downstream(config: ExperimentConfig, data_dir: Path, run_dir: Path, resume: bool,
                   run_one: RunOne) -> dict[str, Any]:
    """Fine-tune the saved model on each downstream task with ``run_one`` (a single run), skipping those
    already finished when resuming; returns each task's final score, keyed '<name> <metric>'."""
    scores: dict[str, Any] = {}
    for name in config.downstream:
        sub = downstream_config(config, name, str(run_dir / "model"))
        sub_dir = run_dir / "downstream" / slug(name)
        if not (resume and finished(sub_dir, sub.protocol.rounds)):
            log.info("%s: fine-tuning on downstream task %s", config.name, name)
            run_one(sub, data_dir, sub_dir, resume=resume and (sub_dir / "config.yaml").exists())
        scores.update(downstream_scores(run_dir, [slug(name)]))
    return scores


def downstream_scores(run_dir: Path, names: list[str] | None = None) -> dict[str, Any]:
    """Final scores of a run's finished downstream fine-tuning runs, keyed '<name> <metric>'."""
    folder = run_dir / "downstream"
    found = names if names is not None else sorted(p.name for p in folder.glob("*") if (p / "data.json").is_file())
    scores: dict[str, Any] = {}
    for name in found:
        metric, direction = get_task(task_of(folder / name)).target_metric()
        evaluation = yaml.safe_load((folder / name / "config.yaml").read_text()).get("eval", {})
        scores[f"{name} {metric}"] = summarize(read_metrics(folder / name), metric, direction,
                                               select=evaluation.get("select", "last"))[f"final {metric}"]
    return scores


def task_of(run_dir: Path) -> str:
    """The task a finished run trained, as its data.json records it."""
    return json.loads((run_dir / "data.json").read_text())["task"]
