"""A config with a grid, baselines or seeds is many single runs under one directory, compared in one table."""

from __future__ import annotations

import logging
from pathlib import Path

from fedlm.config import ExperimentConfig, GridRun, expand_runs
from fedlm.run.downstream import run_downstream, task_of
from fedlm.run.environment import environment_note
from fedlm.run.lock import run_lock
from fedlm.run.placement import Placement
from fedlm.run.recorder import finished, read_metrics, slug
from fedlm.run.report import markdown_table, plot_grid, summarize
from fedlm.run.rundir import clear_run, read_written_config, refuse_existing, write_config
from fedlm.run.seeds import SeededRow, seeded_table
from fedlm.run.single import SIMULATION, run_single
from fedlm.tasks import get_task

log = logging.getLogger("fedlm")


def run_config(config: ExperimentConfig, data_dir: Path, output_dir: Path | None = None,
               overwrite: bool = False, placement: Placement = SIMULATION) -> Path:
    """Run a config, or every combination of its grid (under every seed); returns the run (or grid) directory.
    A directory that already holds a run is refused unless ``overwrite`` (then each run replaces its own once
    it has loaded). An ``output_dir`` given here replaces the config's, so the written config says where the
    runs went and their caches (partitions, tokenizers) go there too."""
    if output_dir is not None:
        config = config.model_copy(update={"output_dir": str(output_dir)})
    root = Path(config.output_dir) / slug(config.name)
    refuse_existing(root, overwrite)
    runs = expand_runs(config)
    if len(runs) == 1 and not runs[0].label:
        row = run_single(config, data_dir, root, overwrite=overwrite, placement=placement)
        print(markdown_table([row]))
        return root
    return run_grid(config, runs, data_dir, root, overwrite=overwrite, placement=placement)


def run_grid(config: ExperimentConfig, runs: list[GridRun], data_dir: Path, root: Path,
             resume: bool = False, overwrite: bool = False, placement: Placement = SIMULATION) -> Path:
    """Every run of the grid (resuming: the unfinished ones, each seed's on its own), then comparison.md (mean ±
    sd over seeds, verdicts, equivalence verdicts given ``eval.equivalence_band``, every seed's row) and
    comparison.png (each setting's mean with its 95% band). The grid directory is this process's alone meanwhile
    (each run's too)."""
    with run_lock(root):
        return _run_grid_locked(config, runs, data_dir, root, resume, overwrite, placement)


def _run_grid_locked(config: ExperimentConfig, runs: list[GridRun], data_dir: Path, root: Path, resume: bool,
                     overwrite: bool, placement: Placement) -> Path:
    if overwrite and not (root / "grid.yaml").is_file():
        clear_run(root)  # a single run where the grid goes: its files would not be replaced one by one
    root.mkdir(parents=True, exist_ok=True)
    write_config(root / "grid.yaml", config)
    warn_without_isolated(config.name, runs)
    rows: list[SeededRow] = []
    curves: dict[str, list[list[dict]]] = {}
    target, direction = "", "max"
    for run in runs:
        run_dir = root / slug(run.label)
        sub = run.config.model_copy(update={"name": f"{config.name}[{run.label}]"})
        if not (resume and finished(run_dir, sub.protocol.rounds)):
            run_single(sub, data_dir, run_dir, resume=resume and (run_dir / "config.yaml").exists(),
                       overwrite=overwrite, placement=placement)
        records = read_metrics(run_dir)
        target, direction = get_task(task_of(run_dir)).target_metric()
        row = {"run": run.label, **summarize(records, target, direction, sub.eval.target, sub.eval.headline,
                                             sub.eval.select),
               **run_downstream(sub, data_dir, run_dir, True, run_single)}  # finishes an interrupted one
        rows.append(SeededRow(run.setting or config.name, run.group, row, seed=run.seed))
        curves.setdefault(run.setting or config.name, []).append(records)
    plot_grid(list(curves.items()), target, root / "comparison.png", f"{config.name}: {target} per round",
              config.eval.headline)
    table = seeded_table(rows, target, direction, config.eval.equivalence_band)
    table += environment_note(root / slug(run.label) for run in runs)
    (root / "comparison.md").write_text(table)
    print(table)
    return root


def warn_without_isolated(name: str, runs: list[GridRun]) -> None:
    """A grid of personalised methods says so when it lacks isolated training, the baseline that shows what
    clients reach from their own data alone (FedSplitBERT's c = 0)."""
    configs = [run.config for run in runs]
    personalised = any(c.sharing.critical_layer or c.sharing.local for c in configs)
    isolated = any(c.protocol.traits.shares_nothing or c.sharing.critical_layer == 0 for c in configs)
    if personalised and not isolated:
        log.warning("%s compares personalised methods without isolated training; add "
                    "{label: isolated, protocol.kind: isolated} to its method axis (or to baselines)", name)


def resume_run(run_dir: Path, data_dir: Path, placement: Placement = SIMULATION) -> Path:
    """Continue a run (or every unfinished run of a grid, every seed's) from its last checkpoint."""
    if (run_dir / "grid.yaml").is_file():
        config = read_written_config(run_dir / "grid.yaml")
        return run_grid(config, expand_runs(config), data_dir, run_dir, resume=True, placement=placement)
    config = read_written_config(run_dir / "config.yaml")
    row = run_single(config, data_dir, run_dir, resume=True, placement=placement)
    print(markdown_table([row]))
    return run_dir
