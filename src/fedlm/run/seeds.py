"""Several seeds per setting: mean ± sd over the seeds, the 95% Student-t interval of the mean, and verdicts
that say "within noise" when two settings' intervals overlap, so no table reads one seed's gap as a finding.

The tables show mean ± sample standard deviation and the number of seeds; the verdicts (and the bands of the
grid's plot) use the 95% t-interval of the mean, mean ± t(0.975, n - 1) · sd / √n.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fedlm.config import ExperimentConfig
from fedlm.metrics import mean_interval
from fedlm.run.report import format_value, markdown_table

FIXED = ("rounds", "target")  # the same for every seed by construction: shown once, not averaged
PRIOR = "label prior"  # the summary columns of the label-prior baseline start with this
_SEED_SUFFIX = re.compile(r"(?:^|[,_])seed=-?\d+$")


@dataclass(frozen=True)
class SeedStats:
    """One number measured under several seeds; ``missing`` seeds gave none (e.g. never reached the target)."""

    values: tuple[float, ...]
    missing: int = 0

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return mean_interval(self.values)[0]

    @property
    def sd(self) -> float:
        return mean_interval(self.values)[1]

    @property
    def interval(self) -> tuple[float, float] | None:
        """The 95% t-interval of the mean; None from one seed, which shows no spread."""
        mean, _, half = mean_interval(self.values)
        return None if math.isnan(half) else (mean - half, mean + half)

    def __str__(self) -> str:
        text = format_value(self.mean) if self.n < 2 else f"{format_value(self.mean)} ± {format_value(self.sd)}"
        return f"{text} ({self.n}/{self.n + self.missing})" if self.missing else text

    def fixed(self, digits: int = 3, interval: bool = False) -> str:
        """'mean ± sd (n seeds)' with a fixed number of decimals, for hand-laid result tables; with ``interval``
        the 95% t-interval follows. One seed reads '(1 seed)', no seeds '-'."""
        if not self.n:
            return "-"
        if self.n < 2:
            return f"{self.mean:.{digits}f} (1 seed)"
        text = f"{self.mean:.{digits}f} ± {self.sd:.{digits}f} ({self.n} seeds)"
        if interval and self.interval is not None:
            low, high = self.interval
            text += f" [{low:.{digits}f}, {high:.{digits}f}]"
        return text


def overlap(a: SeedStats, b: SeedStats) -> bool | None:
    """Whether the two 95% intervals share a point; None when either has a single seed."""
    ia, ib = a.interval, b.interval
    if ia is None or ib is None:
        return None
    return ia[0] <= ib[1] and ib[0] <= ia[1]


def verdict(name: str, stats: SeedStats, other_name: str, other: SeedStats, direction: str) -> str:
    """One line comparing two settings' scores: 'within noise' exactly when their 95% intervals overlap."""
    same = overlap(stats, other)
    if same is None:
        return f"{name} vs {other_name}: one seed, no interval; cannot tell them apart (add seeds)"
    shown = f"{_interval_text(stats)} vs {_interval_text(other)}"
    if same:
        return f"{name} vs {other_name}: within noise (95% intervals {shown} overlap)"
    better = stats.mean > other.mean if direction == "max" else stats.mean < other.mean
    return f"{name} vs {other_name}: {'better' if better else 'worse'} (95% intervals {shown} are disjoint)"


def paired_difference(diffs: Sequence[float], digits: int = 3, words: tuple[str, str] = ("better", "worse")) -> str:
    """Same-seed differences of two settings as 'mean [low, high] word (n seeds)', the 95% t-interval of their
    mean: ``words[0]`` where the interval lies above 0, ``words[1]`` where below, else 'within noise'."""
    if not diffs:
        return "-"
    mean, _, half = mean_interval(diffs)
    if math.isnan(half):
        return f"{mean:+.{digits}f} (1 seed)"
    word = words[0] if mean - half > 0 else words[1] if mean + half < 0 else "within noise"
    return f"{mean:+.{digits}f} [{mean - half:+.{digits}f}, {mean + half:+.{digits}f}] {word} ({len(diffs)} seeds)"


def _interval_text(stats: SeedStats) -> str:
    low, high = stats.interval or (math.nan, math.nan)
    return f"[{format_value(low)}, {format_value(high)}]"


def setting_key(config: dict[str, Any]) -> str:
    """What a run's config.yaml says apart from its seed and name: runs with equal keys are seeds of one setting.
    The config is read through the current schema first, so a key added since a run was written counts as its
    default there (seeds run before and after such an addition stay one setting); as written where it no longer
    validates."""
    with contextlib.suppress(ValidationError):
        config = ExperimentConfig.model_validate(config).model_dump(mode="json")
    kept = {k: v for k, v in config.items() if k not in ("seed", "seeds", "name", "output_dir")}
    return json.dumps(kept, sort_keys=True, default=str)


def setting_label(run_label: str) -> str:
    """A run's label (or directory name) without its seed: 'method=fedavg,seed=1' -> 'method=fedavg'."""
    return _SEED_SUFFIX.sub("", run_label)


def aggregate(label: str, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The summary rows of one setting's seeds as one row: 'seeds' = n, each number as ``SeedStats``."""
    out: dict[str, Any] = {"run": label, "seeds": len(rows)}
    for key in dict.fromkeys(k for row in rows for k in row if k != "run"):
        values = [row.get(key) for row in rows]
        numbers = tuple(float(v) for v in values if _is_number(v))
        if key in FIXED and len({repr(v) for v in values}) == 1:
            out[key] = values[0]
        elif numbers:
            out[key] = SeedStats(numbers, missing=len(values) - len(numbers))
        else:
            out[key] = " / ".join(dict.fromkeys(format_value(v) for v in values))
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SeededRow:
    """One run's summary row, with the setting it is a seed of and the group its verdicts are drawn within
    (None: compared within every group, as a baseline run once beside a grid)."""

    setting: str
    group: str | None
    row: dict[str, Any]
    key: str | None = None  # what makes runs seeds of one setting; the setting's label where not given


def aggregate_settings(runs: Sequence[SeededRow]) -> list[tuple[str | None, dict[str, Any]]]:
    """(group, aggregated row) per setting, in the order settings first appear."""
    by_setting: dict[tuple[str | None, str], list[SeededRow]] = {}
    for run in runs:
        by_setting.setdefault((run.group, run.key or run.setting), []).append(run)
    return [(members[0].group, aggregate(members[0].setting, [m.row for m in members]))
            for members in by_setting.values()]


Cell = tuple[str, str, dict[str, Any], str]  # (row, column, summary, metric) of ``report.pivot_table``


def merge_cells(cells: Sequence[Cell], keys: Sequence[str]) -> list[Cell]:
    """Pivot cells of one (row, column) that are seeds of one setting (equal ``keys``) as one cell whose
    numbers are ``SeedStats``; cells that ran once are kept as they are."""
    merged: dict[tuple[str, str, str], list[Cell]] = {}
    for cell, key in zip(cells, keys, strict=True):
        merged.setdefault((cell[0], cell[1], key), []).append(cell)
    return [members[0] if len(members) == 1 else
            (members[0][0], members[0][1], aggregate(members[0][1], [m[2] for m in members]), members[0][3])
            for members in merged.values()]


def verdict_lines(settings: Sequence[tuple[str | None, dict[str, Any]]], metric: str, direction: str) -> list[str]:
    """Within each group: every setting against the group's best by mean final score, and the best against the
    clients' label prior where one was scored."""
    key = f"final {metric}"
    groups = list(dict.fromkeys(g for g, _ in settings if g is not None)) or [None]
    lines = []
    for group in groups:
        rows = [row for g, row in settings if (g == group or g is None) and isinstance(row.get(key), SeedStats)]
        if not rows:
            continue
        pick = max if direction == "max" else min
        best_row = pick(rows, key=lambda row: _or_worst(row[key].mean, direction))
        best_name, best = _within(best_row["run"], group), best_row[key]
        where = f"[{group}] " if group else ""
        lines += [f"- {where}{verdict(_within(row['run'], group), row[key], best_name, best, direction)}"
                  for row in rows if row is not best_row]
        prior = next((value for name, value in best_row.items() if name.startswith(PRIOR)), None)
        if isinstance(prior, SeedStats):
            lines.append(f"- {where}{verdict(best_name, best, 'the label prior', prior, direction)}")
    return lines


def _within(name: str, group: str | None) -> str:
    """A setting's label without its group's part, which the verdict line already names."""
    return name.removeprefix(f"{group},") if group else name


def _or_worst(value: float, direction: str) -> float:
    if math.isnan(value):
        return -math.inf if direction == "max" else math.inf
    return value


def _with_interval(row: dict[str, Any], key: str) -> dict[str, Any]:
    """``row`` with the 95% interval of ``key`` in the column after it."""
    out = {}
    for name, value in row.items():
        out[name] = value
        if name == key and isinstance(value, SeedStats) and value.interval is not None:
            out[f"95% interval ({key})"] = _interval_text(value)
    return out


def seeded_table(runs: Sequence[SeededRow], metric: str, direction: str) -> str:
    """The comparison: per setting, mean ± sd over seeds and n seeds, then the verdicts, then every seed's row.
    Settings that all ran once get the plain per-run table and a line saying no verdict can be drawn."""
    settings = aggregate_settings(runs)
    if all(row["seeds"] == 1 for _, row in settings):
        return (markdown_table([run.row for run in runs])
                + "\nOne seed per setting: no intervals, so no verdicts (add `seeds: [0, 1, 2]`).\n")
    lines = verdict_lines(settings, metric, direction)
    return (f"Mean ± sd over seeds ({metric}; verdicts from 95% t-intervals of the mean):\n\n"
            + markdown_table([_with_interval(row, f"final {metric}") for _, row in settings])
            + "\n" + "\n".join(lines or ["- nothing to compare"]) + "\n"
            + "\nEvery seed:\n\n" + markdown_table([run.row for run in runs]))
