"""Experiment tracking (config ``report_to``): every round record of ``metrics.jsonl`` also goes to TensorBoard
or Weights & Biases, with the round as the step, where HF Trainer users look for their curves.

TensorBoard writes ``<run dir>/tensorboard/``, so ``tensorboard --logdir runs/<grid>`` shows a grid's runs side
by side. Each process purges the steps from its first round on, so a resumed run shows the rounds after its
checkpoint once (the interrupted attempt's are hidden) and a run started afresh hides an earlier one's. A
tracker whose package is missing stops the run before it starts, naming what to install.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Mapping
from numbers import Real
from pathlib import Path
from typing import Any, Protocol

from fedlm.config import ExperimentConfig, dump_config
from fedlm.errors import UserError

TENSORBOARD_DIR = "tensorboard"
WANDB_ID = "wandb_id"


class Tracker(Protocol):
    """Receives each round record as the run writes it to ``metrics.jsonl``."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers under their metrics.jsonl keys, nested mappings joined with '/'
    (``test_by_client/3/accuracy``, ``bytes_by_client/2/up``). Lists (clients, failures), flags and scores
    metrics.jsonl holds as null (NaN, inf) are left out; ``round`` is the step, not a scalar."""
    out: dict[str, float] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{tag}/"))
        elif isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and tag != "round":
            out[tag] = float(value)
    return out


class TensorBoardTracker:
    """Scalars in ``log_dir``, and the resolved config as text when the run starts from round 0."""

    def __init__(self, log_dir: Path, config: ExperimentConfig) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("report_to: tensorboard needs the tensorboard package: "
                            "pip install 'fedlm[tracking]'") from None
        self._open = SummaryWriter
        self.log_dir = log_dir
        self.config_text = "    " + dump_config(config).replace("\n", "\n    ")  # a markdown code block
        self.writer: Any = None

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["round"])
        if self.writer is None:  # opened at the first record: its round is where this process purges from
            self.writer = self._open(str(self.log_dir), purge_step=step)
            if step == 0:
                self.writer.add_text("config", self.config_text, 0)
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a round is long: show it now rather than at the writer's next timed flush

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbTracker:
    """One W&B run per fedlm run (project ``$WANDB_PROJECT``, else fedlm), its config logged; a resumed run
    continues the same W&B run, whose id is kept in the run directory."""

    def __init__(self, run_dir: Path, config: ExperimentConfig, resume: bool) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError("report_to: wandb needs the wandb package: pip install wandb") from None
        self._wandb = wandb
        self.run_dir, self.config, self.resume = run_dir, config, resume
        self.run: Any = None

    def log(self, record: dict[str, Any]) -> None:
        if self.run is None:  # started at the first record, so a run that fails to prepare leaves no W&B run
            self.run = self._start()
        self.run.log(scalars(record), step=int(record["round"]))

    def _start(self) -> Any:
        id_file = self.run_dir / WANDB_ID
        run_id = id_file.read_text().strip() if self.resume and id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        return self._wandb.init(project=os.environ.get("WANDB_PROJECT", "fedlm"), name=self.config.name, id=run_id,
                                dir=str(self.run_dir), config=self.config.model_dump(mode="json"), resume="allow")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


class Trackers:
    """The run's trackers as one (none when ``report_to`` is empty)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def open_trackers(config: ExperimentConfig, run_dir: Path, resume: bool) -> Trackers:
    """The trackers ``config.report_to`` names, for ``run_dir``; a missing package is a UserError now, before
    any data is read."""
    trackers: list[Tracker] = []
    if "tensorboard" in config.report_to:
        trackers.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR, config))
    if "wandb" in config.report_to:
        trackers.append(WandbTracker(run_dir, config, resume))
    return Trackers(trackers)
