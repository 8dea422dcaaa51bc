"""The bodies of `fedlm partition` and `fedlm report` (kept out of cli.py so imports stay lazy)."""

from __future__ import annotations

from pathlib import Path

from fedlm.config import ExperimentConfig
from fedlm.errors import UserError


def partition_report(config: ExperimentConfig, data_dir: Path, out_dir: Path | None = None) -> Path:
    """Partition the config's training data exactly as a run would, and write the statistics and plots."""
    from fedlm.data.partition import build_partitioner, partition_cached
    from fedlm.data.partition_stats import write_partition_report
    from fedlm.data.sources import load_source
    from fedlm.experiment import num_clients_of, partition_input, slug

    loaded = load_source(config.data.source, data_dir, columns=config.data.columns,
                         file_format=config.data.format, test_fraction=config.data.test_fraction,
                         seed=config.seed, max_train_examples=config.data.max_train_examples,
                         max_test_examples=config.data.max_test_examples)
    out = out_dir or Path(config.output_dir) / slug(config.name) / "partition"
    out.mkdir(parents=True, exist_ok=True)
    data = partition_input(loaded, "train")
    part = partition_cached(build_partitioner(config.partition.spec()), data, num_clients_of(config),
                            config.seed, Path(config.output_dir) / ".cache")
    summary = write_partition_report(out, part, data, loaded.label_names)
    for key, value in summary.items():
        print(f"{key}: {value}")
    return out


def report_runs(run_dirs: list[Path]) -> None:
    """Print a comparison table of finished runs and redraw their curves."""
    import json

    from fedlm.recorder import read_metrics
    from fedlm.report import markdown_table, plot_run, summarize
    from fedlm.tasks import get_task

    rows = []
    for run_dir in run_dirs:
        meta = run_dir / "data.json"
        if not meta.is_file():
            raise UserError(f"{run_dir} is not a run directory (no data.json); give a directory `fedlm run` wrote")
        target, direction = get_task(json.loads(meta.read_text())["task"]).target_metric()
        records = read_metrics(run_dir)
        plot_run(records, target, run_dir, run_dir.name)
        rows.append({"run": run_dir.name, **summarize(records, target, direction)})
    print(markdown_table(rows))
