"""The run directory: what a run did, written as it goes, so it can be read, plotted and resumed.

    run_dir/config.yaml        the resolved config (the run is reproducible from it and its seed)
    run_dir/data.json          data source, split note, partition sizes
    run_dir/environment.json   versions, threads, processes and device: the run's start and each resume
    run_dir/metrics.jsonl      one record per round
    run_dir/checkpoint/        state.pt: the last checkpoint (global parameters, strategy state, the clients'
                               local states or which client_states/ files hold them), written in one step
    run_dir/model/             the final model (save_pretrained) and tokenizer
    run_dir/*.png, summary.md  learning curves and the summary table
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch

from fedlm.errors import UserError
from fedlm.federation.durable import save_atomic, write_text_atomic
from fedlm.federation.records import FailedRound, RoundRecord

CHECKPOINT = "checkpoint"


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN/Inf become null, tensors and numpy scalars become numbers."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunRecorder:
    """Reads and writes one run directory; creates it only when a run starts afresh (``start_afresh``)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"

    def start_afresh(self, config_yaml: str) -> None:
        """A new run: no metrics from an earlier one, and the resolved config written first (whole or not at
        all, since resuming reads it back)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.metrics_path.exists():
            self.metrics_path.unlink()
        write_text_atomic(self.run_dir / "config.yaml", config_yaml)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        (self.run_dir / name).write_text(json.dumps(_clean(payload), indent=2))

    def write_text(self, name: str, text: str) -> None:
        (self.run_dir / name).write_text(text)

    def log_round(self, record: RoundRecord | FailedRound) -> None:
        """Append one record, on disk before the round's checkpoint is (a resumed run keeps what it names)."""
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(_clean(record.to_dict())) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir)

    def truncate_after(self, round_idx: int) -> None:
        """Drop records of rounds after the checkpoint, so a resumed run does not log them twice (a record
        that a crash cut short while it was appended is one of them: it lacks its newline)."""
        text = self.metrics_path.read_text() if self.metrics_path.is_file() else ""
        whole = text[: text.rfind("\n") + 1]
        kept = [r for r in parse_metrics(whole, self.metrics_path) if r.get("round", 0) <= round_idx]
        write_text_atomic(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / CHECKPOINT / "state.pt"

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """A checkpoint's contents in one atomic step: the file is the old one or the new one."""
        self.checkpoint_path.parent.mkdir(exist_ok=True)
        save_atomic(state, self.checkpoint_path)

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.checkpoint_path
        if not path.is_file():
            return None
        try:
            return torch.load(path, weights_only=False)
        except Exception as exc:  # a damaged file: torch raises many kinds (EOF, unpickling, zip errors)
            raise UserError(f"{path} cannot be read ({type(exc).__name__}): the checkpoint is damaged; start "
                            "the run afresh (fedlm run ... --overwrite)") from None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return parse_metrics(path.read_text(), path)


def parse_metrics(text: str, path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl's ``text``; a line that is not JSON stops with one line naming it."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise UserError(f"{path} line {number} is not valid JSON; delete that line to continue") from None
    return records


def slug(text: str) -> str:
    """A run name as a directory name."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_") or "run"


def finished(run_dir: Path, rounds: int) -> bool:
    """The run recorded its last round, saved its final model and wrote its summary, the last thing a run
    writes (a run killed while saving its model has no summary yet)."""
    records = read_metrics(run_dir)
    return (bool(records) and records[-1].get("round") == rounds and (run_dir / "model").exists()
            and (run_dir / "summary.md").is_file())
