"""The bodies of `fedlm partition` and `fedlm report` (kept out of cli.py so imports stay lazy)."""

from __future__ import annotations

from pathlib import Path

from fedlm.config import ExperimentConfig, section_label
from fedlm.errors import UserError


def partition_report(config: ExperimentConfig, data_dir: Path, out_dir: Path | None = None) -> Path:
    """Partition the config's training data exactly as a run would, and write the statistics and plots."""
    from fedlm.data.partition import build_partitioner, partition_cached
    from fedlm.data.partition_stats import write_partition_report
    from fedlm.data.sources import load_source
    from fedlm.run.prepare import num_clients_of, partition_input
    from fedlm.run.recorder import slug

    loaded = load_source(config.data.source, data_dir, columns=config.data.columns,
                         file_format=config.data.format, test_fraction=config.data.test_fraction,
                         seed=config.seed, max_train_examples=config.data.max_train_examples,
                         max_test_examples=config.data.max_test_examples)
    out = out_dir or Path(config.output_dir) / slug(config.name) / "partition"
    out.mkdir(parents=True, exist_ok=True)
    data = partition_input(loaded, "train")
    part = partition_cached(build_partitioner(config.partition), data, num_clients_of(config),
                            config.seed, Path(config.output_dir) / ".cache")
    summary = write_partition_report(out, part, data, loaded.label_names)
    for key, value in summary.items():
        print(f"{key}: {value}")
    return out


def _run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories, with a grid directory standing for every run inside it."""
    found = []
    for path in paths:
        if (path / "grid.yaml").is_file():
            found.extend(sorted(p.parent for p in path.glob("*/data.json")))
        elif (path / "data.json").is_file():
            found.append(path)
        else:
            raise UserError(f"{path} is not a run or grid directory (no data.json or grid.yaml); "
                            "give a directory `fedlm run` wrote")
    return found


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
                headline: str | None = None) -> str:
    """A comparison table of finished runs (or a rows x cols pivot of their final metric); redraws curves."""
    import json

    import yaml

    from fedlm.run.downstream import downstream_scores
    from fedlm.run.recorder import read_metrics
    from fedlm.run.report import markdown_table, pivot_table, plot_run, summarize
    from fedlm.tasks import get_task

    rows, cells = [], []
    for run_dir in _run_dirs(paths):
        target, direction = get_task(json.loads((run_dir / "data.json").read_text())["task"]).target_metric()
        records = read_metrics(run_dir)
        plot_run(records, target, run_dir, run_dir.name)
        evaluation = yaml.safe_load((run_dir / "config.yaml").read_text()).get("eval", {})
        split = headline or evaluation.get("headline", "test")
        summary = summarize(records, target, direction, evaluation.get("target"), split)
        rows.append({"run": run_dir.name, **summary, **downstream_scores(run_dir)})
        if rows_key and cols_key:
            cells.append((_config_value(run_dir, rows_key), _config_value(run_dir, cols_key), summary, target))
    text = markdown_table(rows)
    if cells:
        text += "\n" + pivot_table(cells)
    print(text)
    return text
