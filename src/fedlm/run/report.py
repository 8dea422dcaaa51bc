"""Metrics -> learning-curve plots and summary tables, for one run or a grid of runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def metric_series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rounds, values = [], []
    for rec in records:
        value = rec.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            rounds.append(int(rec["round"]))
            values.append(float(value))
    return rounds, values


def headline_key(records: Sequence[dict[str, Any]], metric: str, split: str = "test") -> str | None:
    """The key holding the headline metric: the global model's test score, or the clients' mean; with
    split='local', the clients' mean on their own local test sets first (how personalization is judged)."""
    order = [f"test_{metric}", f"test_{metric}_mean", f"local_{metric}_mean"]
    if split == "local":
        order.insert(0, order.pop())
    for key in order:
        if any(key in r for r in records):
            return key
    return None


def plot_run(records: Sequence[dict[str, Any]], metric: str, out_dir: Path, title: str) -> list[Path]:
    """Learning curves of one run: the headline metric, train loss, and cumulative bytes per round."""
    written = []
    key = headline_key(records, metric)
    panels = [(key, metric)] if key else []
    panels.append(("train_loss", "train loss"))
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 3.6))
    for ax, (series_key, label) in zip(axes, panels, strict=False):
        rounds, values = metric_series(records, series_key)
        ax.plot(rounds, values, marker="o", ms=3)
        if series_key == key and f"{key.removesuffix('_mean')}_std" in records[-1]:
            _, std = metric_series(records, f"{key.removesuffix('_mean')}_std")
            if len(std) == len(values):
                ax.fill_between(rounds, [v - s for v, s in zip(values, std, strict=True)],
                                [v + s for v, s in zip(values, std, strict=True)], alpha=0.2)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax = axes[-1]
    rounds, up = metric_series(records, "bytes_up")
    _, down = metric_series(records, "bytes_down")
    ax.plot(rounds, _cumulative_mb(up), label="uploaded")
    ax.plot(rounds, _cumulative_mb(down), label="downloaded")
    ax.set_xlabel("round")
    ax.set_ylabel("cumulative MB")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "learning_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def _cumulative_mb(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total / 1e6)
    return out


def plot_grid(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], metric: str, path: Path, title: str,
              split: str = "test") -> Path:
    """Overlaid learning curves of every run in a grid."""
    legend_rows = (len(runs) + 1) // 2
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2 + 0.2 * legend_rows))
    colors = plt.cm.tab20.colors if len(runs) > 10 else plt.cm.tab10.colors
    for i, (label, records) in enumerate(runs):
        color = colors[i % len(colors)]
        key = headline_key(records, metric, split)
        if key:
            axes[0].plot(*metric_series(records, key), marker="o", ms=3, label=label, color=color)
        axes[1].plot(*metric_series(records, "train_loss"), label=label, color=color)
    axes[0].set_ylabel(metric)
    if metric == "perplexity":  # from thousands at the start to tens: only a log axis shows the methods apart
        axes[0].set_yscale("log")
    axes[1].set_ylabel("train loss")
    for ax in axes:
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    fig.subplots_adjust(bottom=0.12 + 0.2 * legend_rows / (4.2 + 0.2 * legend_rows))
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(records: Sequence[dict[str, Any]], metric: str, direction: str,
              goal: float | None = None, split: str = "test") -> dict[str, Any]:
    """Final and best headline metric, rounds, bytes and time of one run (and, given a goal score, the
    round and the bytes both ways it took to first reach it, FedSplitBERT Table VI's communication cost)."""
    key = headline_key(records, metric, split)
    rounds, values = metric_series(records, key) if key else ([], [])
    start = values[0] if rounds and rounds[0] == 0 else math.nan
    trained = (values[1:] if rounds and rounds[0] == 0 else values) or values  # rounds: 0 -> the start itself
    best = (max if direction == "max" else min)(trained) if trained else math.nan
    last = records[-1] if records else {}
    std_key = _spread_key(key, metric, last)
    reached = _first_reaching(records, key, direction, goal) if key and goal is not None else {}
    return {
        "rounds": int(last.get("round", 0)),
        f"start {metric}": start,
        f"final {metric}": trained[-1] if trained else math.nan,
        f"best {metric}": best,
        "spread (std over clients)": last.get(std_key) if std_key else None,
        "MB up": sum(r.get("bytes_up", 0) for r in records) / 1e6,
        "MB down": sum(r.get("bytes_down", 0) for r in records) / 1e6,
        "wall s": sum(r.get("wall_s", 0.0) for r in records),
        "train s/round": _mean([r["train_s"] for r in records if r.get("round", 0) > 0 and "train_s" in r]),
        **reached,
    }


def _spread_key(key: str | None, metric: str, last: dict[str, Any]) -> str | None:
    """Where the spread over clients is: the headline's own std when it is a mean over clients, else the
    clients' std on their local test splits (a global model scored on each client's own data)."""
    if key and key.endswith("_mean"):
        return f"{key.removesuffix('_mean')}_std"
    local = f"local_{metric}_std"
    return local if local in last else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _first_reaching(records: Sequence[dict[str, Any]], key: str, direction: str, goal: float) -> dict[str, Any]:
    """Round and cumulative MB (up + down) at the first trained round whose headline score reaches ``goal``."""
    sent = 0
    for rec in records:
        sent += rec.get("bytes_up", 0) + rec.get("bytes_down", 0)
        value = rec.get(key)
        if rec.get("round", 0) > 0 and isinstance(value, int | float) and (
                value >= goal if direction == "max" else value <= goal):
            return {"target": goal, "round to target": int(rec["round"]), "MB to target": sent / 1e6}
    return {"target": goal, "round to target": None, "MB to target": None}


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return "(no runs)\n"
    headers = list(dict.fromkeys(h for row in rows for h in row))
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(h)) for h in headers) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def pivot_table(cells: Sequence[tuple[str, str, dict[str, Any], str]]) -> str:
    """Rows x columns of 'final (best)' headline metric; a column that ran once (a baseline) fills every row.

    Each row starts with its starting point (round 0); where runs of a row start from different scores (e.g. a
    centralized baseline scored on the shared test split beside clients scored on their local splits), all of
    them are listed. Runs with an ``eval.target`` add a second table: MB (up + down) and rounds to reach it.
    """
    metric = cells[0][3]
    row_names = list(dict.fromkeys(r for r, _, _, _ in cells))
    col_names = list(dict.fromkeys(c for _, c, _, _ in cells))
    value = {(r, c): s for r, c, s, _ in cells}
    single = {c for c in col_names if sum(1 for r, cc, _, _ in cells if cc == c) == 1}

    def cell(r: str, c: str) -> dict[str, Any] | None:
        return value.get((r, c)) or next((v for (_, cc), v in value.items() if cc == c and c in single), None)

    def starts(r: str) -> str:
        found = [cell(r, c).get(f"start {metric}") for c in col_names if cell(r, c)]
        unique = list(dict.fromkeys(_fmt(v) for v in found if isinstance(v, float)))
        return " / ".join(unique) or "-"

    lines = [f"| {metric}: final (best) | start (round 0) | " + " | ".join(col_names) + " |",
             "|---|---|" + "---|" * len(col_names)]
    for r in row_names:
        out = [f"{_fmt(s[f'final {metric}'])} ({_fmt(s[f'best {metric}'])})" if (s := cell(r, c)) else "-"
               for c in col_names]
        lines.append(f"| {r} | {starts(r)} | " + " | ".join(out) + " |")
    if any("MB to target" in s for s in value.values()):
        lines += ["", "| MB to target (round) | target | " + " | ".join(col_names) + " |",
                  "|---|---|" + "---|" * len(col_names)]
        for r in row_names:
            goals = [s.get("target") for c in col_names if (s := cell(r, c))]
            out = [f"{_fmt(s.get('MB to target'))} ({_fmt(s.get('round to target'))})" if (s := cell(r, c)) else "-"
                   for c in col_names]
            lines.append(f"| {r} | {_fmt(next((g for g in goals if g is not None), None))} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"
