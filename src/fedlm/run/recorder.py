"""The run directory: what a run did, written as it goes, so it can be read, plotted and resumed.

    run_dir/config.yaml        the resolved config (the run is reproducible from it and its seed)
    run_dir/data.json          data source, split note, partition sizes
    run_dir/metrics.jsonl      one record per round
    run_dir/checkpoint/        global parameters, strategy state, client local states of the last round
    run_dir/model/             the final model (save_pretrained) and tokenizer
    run_dir/*.png, summary.md  learning curves and the summary table
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from fedlm.errors import UserError

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
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = run_dir / "metrics.jsonl"

    def start_afresh(self, config_yaml: str) -> None:
        """A new run: no metrics from an earlier one, and the resolved config written first."""
        if self.metrics_path.exists():
            self.metrics_path.unlink()
        self.write_text("config.yaml", config_yaml)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        (self.run_dir / name).write_text(json.dumps(_clean(payload), indent=2))

    def write_text(self, name: str, text: str) -> None:
        (self.run_dir / name).write_text(text)

    def log_round(self, record: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(_clean(record)) + "\n")

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir)

    def truncate_after(self, round_idx: int) -> None:
        """Drop records of rounds after the checkpoint, so a resumed run does not log them twice."""
        kept = [r for r in self.records() if r.get("round", 0) <= round_idx]
        self.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def save_checkpoint(self, round_idx: int, state: dict[str, Any]) -> None:
        folder = self.run_dir / CHECKPOINT
        folder.mkdir(exist_ok=True)
        tmp = folder / "state.pt.tmp"
        torch.save({"round": round_idx, **state}, tmp)
        tmp.replace(folder / "state.pt")

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.run_dir / CHECKPOINT / "state.pt"
        if not path.is_file():
            return None
        return torch.load(path, weights_only=False)

    @property
    def client_store_path(self) -> Path:
        (self.run_dir / CHECKPOINT).mkdir(exist_ok=True)
        return self.run_dir / CHECKPOINT / "clients.pt"


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
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
    """The run recorded its last round and saved its final model."""
    records = read_metrics(run_dir)
    return bool(records) and records[-1].get("round") == rounds and (run_dir / "model").exists()
