"""A config with a grid (or baselines) is many single runs under one directory, compared in one table."""

from __future__ import annotations

from pathlib import Path

from fedlm.config import ExperimentConfig, dump_config, expand_grid, read_yaml, validate
from fedlm.errors import UserError
from fedlm.run.downstream import run_downstream, task_of
from fedlm.run.recorder import finished, read_metrics, slug
from fedlm.run.report import markdown_table, plot_grid, summarize
from fedlm.run.single import run_single
from fedlm.tasks import get_task


def run_config(config: ExperimentConfig, data_dir: Path, output_dir: Path | None = None) -> Path:
    """Run a config, or every combination of its grid; returns the run (or grid) directory."""
    root = (output_dir or Path(config.output_dir)) / slug(config.name)
    runs = expand_grid(config)
    if len(runs) == 1 and not runs[0][0]:
        row = run_single(config, data_dir, root)
        print(markdown_table([row]))
        return root
    return run_grid(config, runs, data_dir, root)


def run_grid(config: ExperimentConfig, runs: list[tuple[str, ExperimentConfig]], data_dir: Path, root: Path,
             resume: bool = False) -> Path:
    """Every run of the grid (resuming: the unfinished ones), then comparison.md and comparison.png."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "grid.yaml").write_text(dump_config(config))
    rows, curves = [], []
    target = ""
    for label, sub in runs:
        run_dir = root / slug(label)
        if not (resume and finished(run_dir, sub.protocol.rounds)):
            sub = sub.model_copy(update={"name": f"{config.name}[{label}]"})
            run_single(sub, data_dir, run_dir, resume=resume and (run_dir / "config.yaml").exists())
        records = read_metrics(run_dir)
        target, direction = get_task(task_of(run_dir)).target_metric()
        rows.append({"run": label, **summarize(records, target, direction, sub.eval.target, sub.eval.headline),
                     **run_downstream(sub, data_dir, run_dir, True, run_single)})  # finishes an interrupted one
        curves.append((label, records))
    plot_grid(curves, target, root / "comparison.png", f"{config.name}: {target} per round", config.eval.headline)
    table = markdown_table(rows)
    (root / "comparison.md").write_text(table)
    print(table)
    return root


def resume_run(run_dir: Path, data_dir: Path) -> Path:
    """Continue a run (or every unfinished run of a grid) from its last checkpoint."""
    if (run_dir / "grid.yaml").is_file():
        config = validate(read_yaml(run_dir / "grid.yaml"))
        return run_grid(config, expand_grid(config), data_dir, run_dir, resume=True)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--resume {run_dir}: no config.yaml there; give the directory a run wrote")
    config = validate(read_yaml(run_dir / "config.yaml"))
    row = run_single(config, data_dir, run_dir, resume=True)
    print(markdown_table([row]))
    return run_dir
