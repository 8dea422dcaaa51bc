"""Metrics -> learning-curve plots and summary tables, for one run or a grid of runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

from fedlm.metrics import mean_interval

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


def plot_grid(runs: Sequence[tuple[str, Sequence[Sequence[dict[str, Any]]]]], metric: str, path: Path, title: str,
              split: str = "test") -> Path:
    """Overlaid learning curves of every setting in a grid, each given as its seeds' records: one seed is drawn
    as it is, several as their mean per round with the 95% t-interval of the mean shaded."""
    legend_rows = (len(runs) + 1) // 2
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2 + 0.2 * legend_rows))
    colors = plt.cm.tab20.colors if len(runs) > 10 else plt.cm.tab10.colors
    for i, (label, seeds) in enumerate(runs):
        color = colors[i % len(colors)]
        name = f"{label} (mean of {len(seeds)} seeds)" if len(seeds) > 1 else label
        key = next((k for records in seeds if (k := headline_key(records, metric, split))), None)
        for ax, series_key, marker in ((axes[0], key, "o"), (axes[1], "train_loss", None)):
            if series_key is None:
                continue
            rounds, mean, low, high = seed_band(seeds, series_key)
            ax.plot(rounds, mean, marker=marker, ms=3, label=name, color=color)
            if len(seeds) > 1:
                ax.fill_between(rounds, low, high, color=color, alpha=0.15, linewidth=0)
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


def seed_band(seeds: Sequence[Sequence[dict[str, Any]]], key: str
              ) -> tuple[list[int], list[float], list[float], list[float]]:
    """Per round: the mean over seeds of ``key`` and its 95% t-interval (the mean itself where one seed has it)."""
    by_round: dict[int, list[float]] = {}
    for records in seeds:
        for round_idx, value in zip(*metric_series(records, key), strict=True):
            by_round.setdefault(round_idx, []).append(value)
    rounds = sorted(by_round)
    stats = [mean_interval(np.array(by_round[r])) for r in rounds]
    half = [0.0 if math.isnan(h) else h for _, _, h in stats]
    means = [m for m, _, _ in stats]
    return rounds, means, [m - h for m, h in zip(means, half, strict=True)], [
        m + h for m, h in zip(means, half, strict=True)]


def summarize(records: Sequence[dict[str, Any]], metric: str, direction: str,
              goal: float | None = None, split: str = "test", select: str = "last") -> dict[str, Any]:
    """Final and best headline metric, rounds, bytes and time of one run (and, given a goal score, the
    round and the bytes both ways it took to first reach it, FedSplitBERT Table VI's communication cost).
    ``select`` best (eval.select): the final scores are those of the evaluated round with the best validation
    headline, the model the run delivers; with a validation split, its score at that round is ``val <metric>``."""
    key = headline_key(records, metric, split)
    rounds, values = metric_series(records, key) if key else ([], [])
    start = values[0] if rounds and rounds[0] == 0 else math.nan
    trained = (values[1:] if rounds and rounds[0] == 0 else values) or values  # rounds: 0 -> the start itself
    best = (max if direction == "max" else min)(trained) if trained else math.nan
    final = trained[-1] if trained else math.nan
    chosen = _selected(records, metric, direction, select)
    if "selected round" in chosen:
        final = dict(zip(rounds, values, strict=True)).get(chosen["selected round"], math.nan)
    last = records[-1] if records else {}
    std_key = _spread_key(key, metric, last)
    reached = _first_reaching(records, key, direction, goal) if key and goal is not None else {}
    prior = _label_prior(records, metric) if key and key.startswith("local_") else {}
    return {
        "rounds": int(last.get("round", 0)),
        f"start {metric}": start,
        f"final {metric}": final,
        f"best {metric}": best,
        **chosen,
        **prior,
        "spread (std over clients)": last.get(std_key) if std_key else None,
        "MB up": sum(r.get("bytes_up", 0) for r in records) / 1e6,
        "MB down": sum(r.get("bytes_down", 0) for r in records) / 1e6,
        "wall s": sum(r.get("wall_s", 0.0) for r in records),
        "train s/round": _mean([r["train_s"] for r in records if r.get("round", 0) > 0 and "train_s" in r]),
        **reached,
        **_privacy(records),
        **_attack_success(records),
        **_flagged(records),
    }


def _selected(records: Sequence[dict[str, Any]], metric: str, direction: str, select: str) -> dict[str, Any]:
    """The validation score the final one goes with: at the best validation round under eval.select best (and
    that round), else at the last evaluated round; {} without validation scores."""
    found = best_validation_round(records, metric, direction)
    if found is None:
        return {}
    if select != "best":
        return {f"val {metric}": metric_series(records, f"val_{metric}")[1][-1]}
    return {"selected round": found[0], f"val {metric}": found[1]}


def best_validation_round(records: Sequence[dict[str, Any]], metric: str,
                          direction: str) -> tuple[int, float] | None:
    """The evaluated round with the best ``val_<metric>`` (the first of equals) and its value; None if no record
    has one. The summary's final scores and the model eval.select: best saves are chosen by this one rule."""
    rounds, values = metric_series(records, f"val_{metric}")
    if not rounds:
        return None
    pick = (max if direction == "max" else min)(range(len(values)), key=values.__getitem__)
    return rounds[pick], values[pick]


def _flagged(records: Sequence[dict[str, Any]], shown: int = 3) -> dict[str, Any]:
    """The clients a robust rule dropped or down-weighted in most rounds ('3 (5/5 rounds), ...'), {} if none: who
    looked malicious to the defence. Per round, ``defence`` and ``update_norms`` in metrics.jsonl say more."""
    defended = [r["defence"] for r in records if isinstance(r.get("defence"), dict)]
    counts: dict[str, int] = {}
    for defence in defended:
        for client in {*map(str, defence.get("dropped", [])), *defence.get("down_weighted", {})}:
            counts[client] = counts.get(client, 0) + 1
    if not counts:
        return {}
    top = sorted(counts, key=lambda c: (-counts[c], int(c)))[:shown]
    return {"flagged by the aggregator": ", ".join(f"{c} ({counts[c]}/{len(defended)} rounds)" for c in top)}


def _attack_success(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A backdoor's final and best success rate (share of triggered test examples given its target), {} without
    one: beside the clean headline, what a defence let through."""
    rates = [r["attack_success_rate"] for r in records if r.get("round", 0) > 0 and "attack_success_rate" in r]
    return {"final attack success": rates[-1], "max attack success": max(rates)} if rates else {}


def _privacy(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's final epsilon at its delta (differential privacy), {} without DP; "inf" where noise was 0 (the
    record holds null: JSON has no infinity)."""
    last = next((r for r in reversed(records) if "dp_epsilon" in r), None)
    if last is None:
        return {}
    eps = last["dp_epsilon"]
    return {f"epsilon ({last['dp_kind']}, delta={last['dp_delta']:g})": "inf" if eps is None else eps}


def _label_prior(records: Sequence[dict[str, Any]], metric: str) -> dict[str, Any]:
    """The clients' mean label-prior score on their local test sets (each client predicting the majority label
    of its own training data), beside the local headline it must be read against; {} where none was scored."""
    key = f"local_prior_{metric}_mean"
    value = next((r[key] for r in reversed(records) if isinstance(r.get(key), int | float)), None)
    return {} if value is None else {f"label prior {metric} (local)": value}


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
        lines.append("| " + " | ".join(format_value(row.get(h)) for h in headers) + " |")
    return "\n".join(lines) + "\n"


def format_value(value: Any) -> str:
    """A table cell: '-' for nothing or NaN, floats to 4 decimals (1 from 100 up), anything else as its str
    (a score over seeds shows its own mean ± sd)."""
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

    def unique(r: str, key: str) -> str:
        found = [format_value(s.get(key)) for c in col_names if (s := cell(r, c))]
        return " / ".join(dict.fromkeys(v for v in found if v != "-")) or "-"

    prior = f"label prior {metric} (local)"
    extra = [prior] if any(prior in s for s in value.values()) else []
    lines = [f"| {metric}: final (best) | start (round 0) | " + "".join(f"{e} | " for e in extra)
             + " | ".join(col_names) + " |", "|---|---|" + "---|" * (len(col_names) + len(extra))]
    for r in row_names:
        out = [f"{format_value(s[f'final {metric}'])} ({format_value(s[f'best {metric}'])})" if (s := cell(r, c))
               else "-" for c in col_names]
        lines.append(f"| {r} | {unique(r, f'start {metric}')} | " + "".join(f"{unique(r, e)} | " for e in extra)
                     + " | ".join(out) + " |")
    if any("MB to target" in s for s in value.values()):
        lines += ["", "| MB to target (round) | target | " + " | ".join(col_names) + " |",
                  "|---|---|" + "---|" * len(col_names)]
        for r in row_names:
            goals = [s.get("target") for c in col_names if (s := cell(r, c))]
            out = [f"{format_value(s.get('MB to target'))} ({format_value(s.get('round to target'))})"
                   if (s := cell(r, c)) else "-" for c in col_names]
            goal = format_value(next((g for g in goals if g is not None), None))
            lines.append(f"| {r} | {goal} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"
