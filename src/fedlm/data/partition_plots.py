"""Figures of a partition: FedNLP's clients × labels heatmap (Fig. 4), client × client Jensen–Shannon
heatmap (Fig. 3) and client-size histogram (Fig. 6).

Figures are drawn on matplotlib's Agg canvas directly (no pyplot), so nothing needs a display and
the process-wide backend of other code is left alone.  Callers pass at most a few hundred rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure


def _shown_title(what: str, shown: int, total: int) -> str:
    """Say when only the first clients are drawn, so a reader does not take them for all."""
    return what if shown >= total else f"{what} (first {shown} of {total} clients)"


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_label_heatmap(path: Path, fractions: np.ndarray, label_names: list[str], total_clients: int) -> None:
    """Share of each label in each client's data, one row per client."""
    rows, cols = fractions.shape
    fig = Figure(figsize=(max(4.0, 0.35 * cols + 2), max(3.0, 0.06 * rows + 2)))
    ax = fig.add_subplot()
    image = ax.imshow(fractions, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_xticks(range(cols), label_names, rotation=90 if cols > 8 else 0, fontsize=7)
    ax.set_xlabel("label")
    ax.set_ylabel("client")
    ax.set_title(_shown_title("Label distribution per client", rows, total_clients), fontsize=9)
    fig.colorbar(image, ax=ax, label="share of client's examples")
    _save(fig, path)


def plot_js_heatmap(path: Path, divergence: np.ndarray, total_clients: int) -> None:
    """Client × client Jensen–Shannon divergence of label distributions; darker = more different, as in
    FedNLP Fig. 3."""
    fig = Figure(figsize=(6.0, 5.0))
    ax = fig.add_subplot()
    image = ax.imshow(divergence, cmap="magma_r", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_xlabel("client")
    ax.set_ylabel("client")
    ax.set_title(_shown_title("Jensen–Shannon divergence", divergence.shape[0], total_clients), fontsize=9)
    fig.colorbar(image, ax=ax, label="JS divergence (bits)")
    _save(fig, path)


def plot_size_histogram(path: Path, sizes: np.ndarray) -> None:
    """Distribution of the number of examples per client (all clients: a histogram aggregates)."""
    fig = Figure(figsize=(6.0, 4.0))
    ax = fig.add_subplot()
    ax.hist(sizes, bins=min(50, max(5, int(np.sqrt(sizes.size)))), color="tab:blue", edgecolor="white")
    ax.set_xlabel("examples per client")
    ax.set_ylabel("clients")
    ax.set_title(f"Client sizes ({sizes.size} clients, {int(sizes.sum())} examples)", fontsize=9)
    _save(fig, path)
