"""Per-client statistics of a partition: the table, the spreads, and the report that writes them.  Each client's
groups (the values of the data's extra columns, such as the ``group`` a natural partition splits on) are in the
table too, so a natural partition says which hospital or site each client is."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
from scipy.spatial.distance import jensenshannon

from fedlm.data import partition_plots
from fedlm.data.partition.base import Partition, PartitionInput
from fedlm.data.partition.words import client_means, client_vocab_sizes, word_matrix, words_per_text

SCORE_BINS = 10
HEATMAP_CLIENTS = 100
GROUPS_SHOWN = 5  # a client's distinct group values listed in partition.csv; more are counted


def label_classes(labels: np.ndarray, label_names: list[str] | None) -> tuple[np.ndarray, list[str]]:
    """Integer class per example and the class names; regression scores are cut into equal-width
    bins so that their distribution can be shown and compared like labels."""
    if labels.dtype.kind in "iub":
        classes = labels.astype(np.int64)
        count = int(classes.max()) + 1 if classes.size else 0
        if label_names is not None and len(label_names) >= count:
            return classes, list(label_names)
        return classes, [str(c) for c in range(count)]
    edges = np.linspace(float(labels.min()), float(labels.max()), SCORE_BINS + 1)
    classes = np.clip(np.searchsorted(edges, labels, side="right") - 1, 0, SCORE_BINS - 1)
    return classes, [f"{lo:.2f}-{hi:.2f}" for lo, hi in itertools.pairwise(edges)]


def label_counts(
    assignment: np.ndarray, num_clients: int, classes: np.ndarray, num_classes: int
) -> np.ndarray:
    """Clients × classes count matrix."""
    kept = assignment >= 0
    flat = assignment[kept].astype(np.int64) * num_classes + classes[kept]
    return np.bincount(flat, minlength=num_clients * num_classes).reshape(num_clients, num_classes)


def distributions(counts: np.ndarray) -> np.ndarray:
    """Row-normalised counts (an empty client gets an all-zero row)."""
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen–Shannon divergence in bits along the last axis (scipy returns its square root)."""
    return jensenshannon(p, q, axis=-1, base=2) ** 2


def spread(values: np.ndarray) -> dict[str, float | None]:
    """Mean, std, min and max across clients, ignoring empty clients' NaNs (None when nothing is left:
    JSON has no NaN)."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return dict.fromkeys(("mean", "std", "min", "max"))
    stats = {"mean": finite.mean(), "std": finite.std(), "min": finite.min(), "max": finite.max()}
    return {key: float(value) for key, value in stats.items()}


def client_statistics(partition: Partition, data: PartitionInput) -> dict[str, np.ndarray]:
    """The per-client numbers the FDAPT skews are defined on: examples, mean words, vocabulary."""
    k = partition.num_clients
    stats = {"examples": partition.sizes().astype(np.float64)}
    if data.texts is not None:
        words = word_matrix(data.texts)
        stats["mean_words"] = client_means(partition.assignment, k, words_per_text(words).astype(float))
        stats["vocab_size"] = client_vocab_sizes(partition.assignment, k, words).astype(np.float64)
    return stats


def client_groups(partition: Partition, values: Any) -> list[list[str]]:
    """Each client's distinct values of a column (as text, sorted): one per client for a natural partition."""
    unique, inverse = np.unique(np.asarray(values).astype(str), return_inverse=True)
    kept = partition.assignment >= 0
    pairs = np.unique(partition.assignment[kept].astype(np.int64) * unique.size + inverse[kept])
    clients, codes = np.divmod(pairs, max(unique.size, 1))
    offsets = np.searchsorted(clients, np.arange(partition.num_clients + 1))
    return [unique[codes[lo:hi]].tolist() for lo, hi in itertools.pairwise(offsets)]


def group_columns(partition: Partition, data: PartitionInput) -> dict[str, list[list[str]]]:
    """The clients' groups of every extra column that groups examples (not an id column: one value a row),
    by the column's shown name."""
    return {data.shown_name(name): client_groups(partition, values) for name, values in data.column_items()
            if len(values) < 2 or len(set(map(str, values))) < len(values)}


def _groups_cell(values: list[str]) -> str:
    shown = "; ".join(values[:GROUPS_SHOWN])
    return shown + (f"; ... (+{len(values) - GROUPS_SHOWN} more)" if len(values) > GROUPS_SHOWN else "")


def _csv_rows(stats: dict[str, np.ndarray], fractions: np.ndarray | None, names: list[str],
              groups: dict[str, list[list[str]]] | None = None) -> list[list]:
    """One row per client: the statistics, the label distribution, then the client's groups."""
    groups = groups or {}
    rows = []
    for client in range(stats["examples"].size):
        row: list[Any] = [client, *(_csv_value(values[client]) for values in stats.values())]
        if fractions is not None:
            row += [f"{x:.4f}" for x in fractions[client]]
        row += [_groups_cell(per_client[client]) for per_client in groups.values()]
        rows.append(row)
    return [["client", *stats, *(f"label_{name}" for name in names), *groups], *rows]


def _csv_value(value: float) -> str:
    """Integers without a decimal point, other numbers to two places."""
    if not np.isfinite(value):
        return ""
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


def _write_csv(path: Path, rows: list[list]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)


def label_section(
    out_dir: Path, partition: Partition, labels: np.ndarray, label_names: list[str] | None
) -> tuple[np.ndarray, list[str], dict[str, float]]:
    """Per-client label distributions, the spread of their JS divergence to the overall distribution,
    and the two heatmaps (first HEATMAP_CLIENTS clients: a 10,000² JS matrix would not be readable)."""
    k = partition.num_clients
    classes, names = label_classes(labels, label_names)
    counts = label_counts(partition.assignment, k, classes, len(names))
    fractions = distributions(counts)
    overall = distributions(counts.sum(axis=0, keepdims=True))[0]
    shown = fractions[:HEATMAP_CLIENTS]
    partition_plots.plot_label_heatmap(out_dir / "label_distribution.png", shown, names, k)
    pairwise = js_divergence(shown[:, None, :], shown[None, :, :])
    partition_plots.plot_js_heatmap(out_dir / "js_divergence.png", pairwise, k)
    return fractions, names, spread(js_divergence(fractions, overall))


def write_partition_report(
    out_dir: Path, partition: Partition, data: PartitionInput, label_names: list[str] | None
) -> dict:
    """Write partition.csv, partition_summary.json and the PNGs (label heatmap, JS heatmap, size
    histogram) to ``out_dir``; return the summary (with, per group column, how many values there are and
    how many each client holds: partition.csv names them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stats = client_statistics(partition, data)
    summary: dict[str, Any] = {
        "num_clients": partition.num_clients,
        "num_examples": int(partition.assignment.size),
        "left_out": partition.left_out,
        "statistics": {name: spread(values) for name, values in stats.items()},
    }
    partition_plots.plot_size_histogram(out_dir / "client_sizes.png", partition.sizes())
    fractions, names = None, []
    if data.labels is not None and len(data.labels):
        fractions, names, js = label_section(out_dir, partition, np.asarray(data.labels), label_names)
        summary["statistics"]["js_to_overall"] = js
    groups = group_columns(partition, data)
    if groups:
        summary["groups"] = {
            name: {"values": len({v for values in per_client for v in values}),
                   "per_client": spread(np.array([len(values) for values in per_client], dtype=np.float64))}
            for name, per_client in groups.items()
        }
    _write_csv(out_dir / "partition.csv", _csv_rows(stats, fractions, names, groups))
    (out_dir / "partition_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
