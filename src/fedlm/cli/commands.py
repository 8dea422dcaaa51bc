"""The bodies of `fedlm partition` and `fedlm report` (kept out of cli.py so imports stay lazy)."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from fedlm.config import ExperimentConfig, section_label
from fedlm.errors import RunStopped, UserError


def partition_report(config: ExperimentConfig, data_dir: Path, out_dir: Path | None = None) -> Path:
    """Partition the config's training data exactly as a run would, and write the statistics and plots.
    Everything from the loaded dataset on is columnar (``fedlm.data.inputs``), and nothing of the model
    stack is imported: on a million rows this costs what the same calls from Python cost."""
    from fedlm.data.inputs import partition_input, partition_labels
    from fedlm.data.partition import build_partitioner, partition_cached
    from fedlm.data.partition_stats import write_partition_report
    from fedlm.data.sources import load_source
    from fedlm.run.recorder import slug

    out = out_dir or Path(config.output_dir) / slug(config.name) / "partition"
    check_writable(out, "the partition report directory (--out)")
    loaded = load_source(config.data.source, data_dir, columns=config.data.columns,
                         file_format=config.data.format, test_fraction=config.data.test_fraction,
                         seed=config.seed, max_train_examples=config.data.max_train_examples,
                         max_test_examples=config.data.max_test_examples, task=config.task)
    data = partition_input(loaded, "train")
    part = partition_cached(build_partitioner(config.partition), data, config.num_clients(),
                            config.seed, Path(config.output_dir) / ".cache")
    summary = write_partition_report(out, part, data, partition_labels(loaded, "train")[1])
    for key, value in summary.items():
        print(f"{key}: {value}")
    return out


def check_writable(path: Path, what: str) -> None:
    """Say in one line why ``path`` (a directory) cannot be written, before any data is read, so a mistyped
    or read-only output directory costs nothing. Nothing is created: a run that then fails on its config or
    data leaves no empty directory behind."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"cannot write {what} {path}: {existing} is not a directory; choose a writable directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {what} {path}: permission denied on {existing}; choose a writable directory")


def _config_value(run_dir: Path, dotted: str) -> str:
    """A config value of a run as a short label ('label_dirichlet(alpha=1.0)' for a whole section)."""
    import yaml

    node = yaml.safe_load((run_dir / "config.yaml").read_text())
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise UserError(f"--rows/--cols key '{dotted}' is not in {run_dir}/config.yaml")
        node = node[part]
    return section_label(node) if isinstance(node, dict) else str(node)


def report_runs(paths: list[Path], rows_key: str | None = None, cols_key: str | None = None,
                headline: str | None = None, band: float | None = None) -> str:
    """A comparison table of finished runs (or a rows x cols pivot of their final metric); redraws curves (for
    one grid, its comparison.png too). Runs whose configs differ only in their seed are one setting: mean ± sd
    over the seeds, and verdicts; with an equivalence ``band`` (else the runs' own ``eval.equivalence_band``),
    equivalence verdicts on same-seed differences beside them."""
    import json

    import yaml

    from fedlm.run.downstream import downstream_scores
    from fedlm.run.environment import environment_note
    from fedlm.run.recorder import read_metrics
    from fedlm.run.report import pivot_table, plot_grid, plot_run, summarize
    from fedlm.run.rundir import run_dirs
    from fedlm.run.seeds import SeededRow, merge_cells, seeded_table, setting_key, setting_label
    from fedlm.tasks import get_task

    if band is not None and not (math.isfinite(band) and band > 0):
        raise UserError(f"--equivalence-band {band:g}: give a margin > 0 in the headline metric's units")
    rows, cells, keys, bands = [], [], [], set()
    curves: dict[str, tuple[str, list[list[dict]]]] = {}
    target, direction, split = "", "max", "test"
    found = run_dirs(paths)
    for run_dir in found:
        target, direction = get_task(json.loads((run_dir / "data.json").read_text())["task"]).target_metric()
        records = read_metrics(run_dir)
        plot_run(records, target, run_dir, run_dir.name)
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        evaluation = config.get("eval", {})
        split = headline or evaluation.get("headline", "test")
        summary = summarize(records, target, direction, evaluation.get("target"), split,
                            evaluation.get("select", "last"))
        pivot = bool(rows_key and cols_key)
        group = _config_value(run_dir, rows_key) if pivot else ""
        key, label = setting_key(config), setting_label(run_dir.name) or run_dir.parent.name  # 'seed=1': a grid's
        rows.append(SeededRow(label, group, {"run": run_dir.name, **summary, **downstream_scores(run_dir)}, key,
                              config.get("seed")))
        bands.add(evaluation.get("equivalence_band"))
        curves.setdefault(key, (label, []))[1].append(records)
        if pivot:
            cells.append((group, _config_value(run_dir, cols_key), summary, target))
            keys.append(key)
    if len(paths) == 1 and (paths[0] / "grid.yaml").is_file() and curves:
        plot_grid(list(curves.values()), target, paths[0] / "comparison.png", f"{paths[0].name}: {target} per round",
                  split)
    if band is None and len(bands - {None}) > 1:
        raise UserError(f"the runs fix different equivalence bands ({', '.join(map(str, sorted(bands - {None})))}): "
                        "give one with --equivalence-band")
    band = band if band is not None else next(iter(bands - {None}), None)
    text = seeded_table(rows, target, direction, band) if rows else "(no runs)\n"
    text += environment_note(found)
    if cells:
        text += "\n" + pivot_table(merge_cells(cells, keys))
    print(text)
    return text


def run_command(args: argparse.Namespace) -> int:
    """`fedlm run`: a config (every run of its grid) or ``--resume``; alone, or as one process of a group
    (``--workers``, ``torchrun``), where rank 0 runs and writes and the others serve its runs."""
    import torch.distributed as dist

    from fedlm.cli import run_dir_of
    from fedlm.cli.workers import join
    from fedlm.config import load_config
    from fedlm.data.sources import resolve_data_dir
    from fedlm.run.grid import resume_run, run_config
    from fedlm.run.placement import Sharded
    from fedlm.run.single import SIMULATION
    from fedlm.run.workers import serve_runs

    if args.resume and args.overwrite:
        raise UserError("--resume continues a run and --overwrite replaces it: give one of them")
    if not args.resume and not args.config:
        raise UserError("fedlm run needs a CONFIG file (or --resume RUN_DIR)")
    data_dir = resolve_data_dir(args.data_dir)
    collective = join(args.worker_timeout_s, args.backend)
    try:
        if not collective.leads:
            serve_runs(collective, data_dir)
            return 0
        placement = Sharded(collective) if collective.world > 1 else SIMULATION
        if args.resume:
            resume_run(Path(args.resume), data_dir, placement)
        else:
            config = load_config(args.config, args.overrides)
            check_writable(Path(args.output_dir or config.output_dir), "the output directory (output_dir)")
            out = run_config(config, data_dir, Path(args.output_dir) if args.output_dir else None, args.overwrite,
                             placement)
            print(f"run directory: {out}")
        collective.broadcast(None)  # no more runs: the other processes exit
        return 0
    except dist.DistError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunStopped(f"another process of this run stopped or did not answer within --worker-timeout-s "
                         f"({args.worker_timeout_s:g} s): {reason}; the run keeps its rounds up to its last "
                         f"checkpoint: continue with `fedlm run --resume {run_dir_of(args)} --workers "
                         f"{collective.world}`"
                         ) from None
    finally:
        collective.close()
