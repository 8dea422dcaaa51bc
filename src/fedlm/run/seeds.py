"""Several seeds per setting: mean ± sd over the seeds, the 95% Student-t interval of the mean, and verdicts
that say "within noise" when two settings' intervals overlap, so no table reads one seed's gap as a finding.

The tables show mean ± sample standard deviation and the number of seeds; the verdicts (and the bands of the
grid's plot) use the 95% t-interval of the mean, mean ± t(0.975, n - 1) · sd / √n. "Within noise" is not
"equivalent": with an equivalence band fixed before the runs (``eval.equivalence_band``), ``equivalence``
also judges each setting's same-seed differences by two one-sided tests (``Equivalence``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fedlm.config import ExperimentConfig
from fedlm.metrics import mean_interval
from fedlm.run.report import format_value, markdown_table

FIXED = ("rounds", "target")  # the same for every seed by construction: shown once, not averaged
PRIOR = "label prior"  # the summary columns of the label-prior baseline start with this
_SEED_SUFFIX = re.compile(r"(?:^|[,_])seed=-?\d+$")
REPORT_ONLY = ("equivalence_band",)  # eval keys that change how runs are judged, not what they compute


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


EQUIVALENT, WITHIN_NOISE, DIFFERS, NOT_MEASURABLE = "equivalent", "within noise", "differs", "not measurable"


@dataclass(frozen=True)
class Equivalence:
    """The equivalence verdict on one pair of settings, with what it was read from."""

    verdict: str  # EQUIVALENT, WITHIN_NOISE, DIFFERS or NOT_MEASURABLE
    n: int  # paired seeds
    mean: float
    interval: tuple[float, float] | None  # 95% t-interval of the mean difference; None below two seeds
    band: float | None

    def text(self, digits: int = 4) -> str:
        """'-0.0040 [-0.0090, +0.0010] equivalent (band ±0.0100; 3 seeds)'; 'not measurable (why)'."""
        if self.interval is None or self.band is None:
            why = "no equivalence band fixed" if self.band is None else f"{self.n} paired seed{'s' * (self.n != 1)}"
            shown = f"{self.mean:+.{digits}f} " if self.n else ""
            return f"{shown}{NOT_MEASURABLE} ({why})"
        low, high = self.interval
        return (f"{self.mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}] {self.verdict} "
                f"(band ±{self.band:.{digits}f}; {self.n} seeds)")


def equivalence(diffs: Sequence[float], band: float | None) -> Equivalence:
    """Same-seed differences of two settings judged as an equivalence claim, two one-sided tests read off the
    95% t-interval of their mean: 'equivalent' only when the whole interval lies strictly inside (-band, +band)
    (each one-sided test at 2.5%); else 'within noise' when it covers 0 (no difference found, no equivalence
    shown either), else 'differs'; 'not measurable' below two paired seeds or without a band. The band is in
    the metric's own units and must be fixed before the runs: one chosen after seeing the interval proves
    nothing. Overlapping intervals never make 'equivalent'. Non-finite differences are left out (``n`` counts
    the rest)."""
    values = [float(d) for d in diffs if _is_number(d)]
    mean, _, half = mean_interval(values)
    if band is None or len(values) < 2 or math.isnan(half):
        return Equivalence(NOT_MEASURABLE, len(values), mean, None, band)
    low, high = mean - half, mean + half
    if -band < low and high < band:
        word = EQUIVALENT
    elif low <= 0 <= high:
        word = WITHIN_NOISE
    else:
        word = DIFFERS
    return Equivalence(word, len(values), mean, (low, high), band)


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
    if isinstance(kept.get("eval"), dict):  # a band fixed for the report leaves the runs one setting
        kept["eval"] = {k: v for k, v in kept["eval"].items() if k not in REPORT_ONLY}
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
    seed: int | None = None  # pairs it with other settings' runs; read from the run's label where not given

    def seed_or_label(self) -> int | None:
        """The seed that pairs this run with the other settings' runs of that seed; None: it pairs with none."""
        if self.seed is not None:
            return self.seed
        found = _SEED_SUFFIX.search(str(self.row.get("run", "")))
        return int(found.group().rsplit("=", 1)[1]) if found else None


def _by_setting(runs: Sequence[SeededRow]) -> list[list[SeededRow]]:
    """The runs of each setting, in the order settings first appear."""
    by_setting: dict[tuple[str | None, str], list[SeededRow]] = {}
    for run in runs:
        by_setting.setdefault((run.group, run.key or run.setting), []).append(run)
    return list(by_setting.values())


def aggregate_settings(runs: Sequence[SeededRow]) -> list[tuple[str | None, dict[str, Any]]]:
    """(group, aggregated row) per setting, in the order settings first appear."""
    return [(members[0].group, aggregate(members[0].setting, [m.row for m in members]))
            for members in _by_setting(runs)]


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


def _group_rows(settings: Sequence[tuple[str | None, Any]], score: Callable[[Any], object], direction: str
                ) -> list[tuple[str | None, list[Any], Any]]:
    """Per group (baselines join every group): its settings with a score and the best of them by mean."""
    groups = list(dict.fromkeys(g for g, _ in settings if g is not None)) or [None]
    pick = max if direction == "max" else min
    out = []
    for group in groups:
        rows = [row for g, row in settings if (g == group or g is None) and isinstance(score(row), SeedStats)]
        if rows:
            out.append((group, rows, pick(rows, key=lambda row: _or_worst(score(row).mean, direction))))
    return out


def verdict_lines(settings: Sequence[tuple[str | None, dict[str, Any]]], metric: str, direction: str) -> list[str]:
    """Within each group: every setting against the group's best by mean final score, and the best against the
    clients' label prior where one was scored."""
    key = f"final {metric}"
    lines = []
    for group, rows, best_row in _group_rows(settings, lambda row: row.get(key), direction):
        best_name, best = _within(best_row["run"], group), best_row[key]
        where = f"[{group}] " if group else ""
        lines += [f"- {where}{verdict(_within(row['run'], group), row[key], best_name, best, direction)}"
                  for row in rows if row is not best_row]
        prior = next((value for name, value in best_row.items() if name.startswith(PRIOR)), None)
        if isinstance(prior, SeedStats):
            lines.append(f"- {where}{verdict(best_name, best, 'the label prior', prior, direction)}")
    return lines


def equivalence_lines(runs: Sequence[SeededRow], metric: str, direction: str, band: float | None) -> list[str]:
    """Within each group: every setting's same-seed differences from the group's best (the pair the verdict
    lines compare) judged by ``equivalence`` against ``band``."""
    key = f"final {metric}"
    settings = [(members[0].group, (aggregate(members[0].setting, [m.row for m in members]),
                                    {m.seed_or_label(): m.row.get(key) for m in members}))
                for members in _by_setting(runs)]
    lines = []
    for group, rows, (best_row, best_seeds) in _group_rows(settings, lambda pair: pair[0].get(key), direction):
        where = f"[{group}] " if group else ""
        for row, seeds in rows:
            if row is best_row:
                continue
            diffs = [seeds[s] - best_seeds[s] for s in seeds if s is not None and s in best_seeds
                     and _is_number(seeds[s]) and _is_number(best_seeds[s])]
            found = equivalence(diffs, band)
            lines.append(f"- {where}{_within(row['run'], group)} - {_within(best_row['run'], group)}: {found.text()}")
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


def seeded_table(runs: Sequence[SeededRow], metric: str, direction: str, band: float | None = None) -> str:
    """The comparison: per setting, mean ± sd over seeds and n seeds, then the verdicts (and, given an
    equivalence ``band``, the equivalence verdicts beside them), then every seed's row. Settings that all ran
    once get the plain per-run table and a line saying no verdict can be drawn."""
    settings = aggregate_settings(runs)
    if all(row["seeds"] == 1 for _, row in settings):
        return (markdown_table([run.row for run in runs])
                + "\nOne seed per setting: no intervals, so no verdicts (add `seeds: [0, 1, 2]`)"
                + (", and equivalence is not measurable" if band is not None else "") + ".\n")
    lines = verdict_lines(settings, metric, direction)
    text = (f"Mean ± sd over seeds ({metric}; verdicts from 95% t-intervals of the mean):\n\n"
            + markdown_table([_with_interval(row, f"final {metric}") for _, row in settings])
            + "\n" + "\n".join(lines or ["- nothing to compare"]) + "\n")
    if band is not None:
        text += (f"\nEquivalence within ±{band:g} (final {metric}; the band fixed before the runs): same-seed "
                 "differences from the group's best, mean [95% t-interval]; equivalent only when the whole "
                 "interval lies inside the band (two one-sided tests), within noise when it covers 0 but leaves "
                 "the band:\n\n"
                 + "\n".join(equivalence_lines(runs, metric, direction, band) or ["- nothing to compare"]) + "\n")
    return text + "\nEvery seed:\n\n" + markdown_table([run.row for run in runs])
