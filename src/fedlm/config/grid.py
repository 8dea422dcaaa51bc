"""Grids, baselines, seeds and downstream runs: one config expanded into many, each labelled."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

from pydantic import (
    ValidationError,
)

from fedlm.config.experiment import ExperimentConfig, format_error, set_dotted, validate
from fedlm.errors import UserError


def is_named_axis(key: str) -> bool:
    """A grid key that is not a config key names an axis whose values are sets of overrides applied together
    (e.g. ``dataset: [{label: sst2, data.source: glue/sst2, partition.mixes: ...}, ...]``)."""
    return "." not in key and key not in ExperimentConfig.model_fields


def _axis_value(where: str, value: Any) -> tuple[dict[str, Any], str]:
    """(overrides, label) of one value of a named axis (``where`` = 'grid.<axis>') or of a baseline."""
    if not isinstance(value, dict):
        raise UserError(f"config error: {where} is a named axis (not a config key), so each value must be a "
                        f"mapping of dotted overrides, got {value!r}")
    if not isinstance(value.get("label", ""), str | int | float):
        raise UserError(f"config error: {where}: label must be a string, got {value['label']!r}")
    overrides = {k: v for k, v in value.items() if k != "label"}
    return overrides, str(value.get("label", _label(overrides)))


@dataclass(frozen=True)
class GridRun:
    """One run of a grid. Runs with one ``setting`` differ only in their seed (their scores are averaged); runs
    with one ``group`` differ in the grid's last axis (a verdict compares them); a baseline's group is None, as
    it is compared within every group."""

    label: str  # the run's own label, seed included: 'method=fedavg,seed=1' (its directory is this, slugged)
    config: ExperimentConfig
    setting: str  # the label without the seed
    group: str | None  # the label without the seed and the last axis
    seed: int | None  # None when the config lists no seeds


def expand_grid(config: ExperimentConfig) -> list[tuple[str, ExperimentConfig]]:
    """Every combination of the grid's values (and every seed), each as (label, config); no grid and no seeds ->
    the config itself."""
    return [(run.label, run.config) for run in expand_runs(config)]


def expand_runs(config: ExperimentConfig) -> list[GridRun]:
    """``expand_grid`` with what each run shares with the others. With seeds, every setting runs under the
    first seed before any runs under the second, so an interrupted grid still compares every setting."""
    seeds = list(config.seeds) or _grid_seeds(config.grid.get("seed"))
    grid = {k: v for k, v in config.grid.items() if k != "seed"}
    if not grid and not config.baselines and not seeds:
        return [GridRun("", config, "", "", None)]
    base = config.model_dump()
    base["grid"], base["baselines"], base["seeds"] = {}, [], []
    if "preset" not in config.model.model_fields_set:  # the default preset: a run whose axis sets a checkpoint
        del base["model"]["preset"]  # loads it (a written preset would build a fresh model instead)
    keys = list(grid)
    # no grid axes: one combination, the config itself (beside its baselines, or under each seed)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]
    settings = []
    for choice in combos + [{"": b} for b in config.baselines]:
        raw = copy.deepcopy(base)
        overrides: dict[str, Any] = {}
        labels: list[str] = []
        for key, value in choice.items():
            if key == "":  # a baseline: dotted overrides, optionally with a label
                baseline_overrides, baseline_label = _axis_value("baselines", value)
                overrides.update(baseline_overrides)
                labels.append(baseline_label)
            elif is_named_axis(key):
                axis_overrides, axis_label = _axis_value(f"grid.{key}", value)
                overrides.update(axis_overrides)
                raw.setdefault("tags", {})[key] = axis_label
                labels.append(f"{key}={axis_label}")
            else:
                overrides[key] = value
                labels.append(_label({key: value}))
        for key, value in overrides.items():
            set_dotted(raw, key.split("."), value)
        if not choice and config.baselines:
            labels.append(config.protocol.kind)  # the config itself beside its baselines: named by its protocol
        group = None if "" in choice else ",".join(labels[:-1])
        settings.append((",".join(labels), group, raw))
    if not seeds:
        return [GridRun(label, validate(raw), label, group, None) for label, group, raw in settings]
    runs = []
    for seed in seeds:
        for label, group, raw in settings:
            seeded = {**raw, "seed": seed}
            runs.append(GridRun(",".join(filter(None, [label, f"seed={seed}"])), validate(seeded), label, group, seed))
    return runs


def _grid_seeds(values: list[Any] | None) -> list[int]:
    """grid.seed as a list of seeds (each an integer, each once)."""
    if values is None:
        return []
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or len(set(values)) != len(values):
        raise UserError(f"config error: grid.seed = {values!r}: give distinct integer seeds, e.g. [0, 1, 2]")
    return list(values)


def section_label(section: dict[str, Any]) -> str:
    """A section with a `kind` as a short label: 'label_dirichlet(alpha=1.0)' (num_clients left out)."""
    params = ",".join(f"{k}={v}" for k, v in section.items() if k not in ("kind", "num_clients"))
    kind = section.get("kind", "")
    return f"{kind}({params})" if params else str(kind)


def _label(overrides: dict[str, Any]) -> str:
    """A readable run label, e.g. 'partition=label_dirichlet(alpha=1.0),protocol=fedavg'."""
    parts = []
    for key, value in overrides.items():
        path = key.split(".")
        if isinstance(value, dict):
            parts.append(f"{key}={section_label(value)}")
        else:
            name = path[-2] if path[-1] == "kind" and len(path) > 1 else path[-1]
            parts.append(f"{name}={value}")
    return ",".join(parts)


def downstream_config(config: ExperimentConfig, name: str, checkpoint: str) -> ExperimentConfig:
    """The fine-tuning run ``name`` of ``config.downstream``, starting from the model saved at ``checkpoint``."""
    raw: dict[str, Any] = {
        "name": f"{config.name}[{name}]", "tags": dict(config.tags), "seed": config.seed,
        "output_dir": config.output_dir,
        "model": {"family": config.model.family, "checkpoint": checkpoint, "preset": None,
                  "max_length": config.model.max_length},
    }
    for key, value in config.downstream[name].items():
        set_dotted(raw, key.split("."), value)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise UserError(format_error(err).replace("config error:", f"config error in downstream.{name}:")) from None
