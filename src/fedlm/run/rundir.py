"""Run directories as things a user keeps: never replaced by accident, and their config read back only whole.

A new run refuses a directory that already holds a run unless told to replace it (``overwrite``), and even
then replaces it only once its own config, data and model have loaded, so a re-run that fails on bad input
leaves the earlier run as it was. The config a run writes ends with ``END_LINE``: a file cut short (a full
disk, a crash while copying) lacks it, and resuming from it would fill the missing keys with defaults.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fedlm.config import ExperimentConfig, dump_config, read_yaml, validate
from fedlm.errors import UserError
from fedlm.federation.durable import write_text_atomic

END_LINE = "# end of the config fedlm wrote (resuming reads only a file that ends with this line)\n"
RUN_FILES = ("config.yaml", "grid.yaml", "metrics.jsonl", "checkpoint")


def config_text(config: ExperimentConfig) -> str:
    """The resolved config as a run directory keeps it (``END_LINE`` last)."""
    return dump_config(config) + END_LINE


def write_config(path: Path, config: ExperimentConfig) -> None:
    write_text_atomic(path, config_text(config))


def read_written_config(path: Path) -> ExperimentConfig:
    """A config a run wrote (config.yaml, grid.yaml), refused in one line if it is missing, cut short or
    invalid."""
    if not path.is_file():
        raise UserError(f"--resume {path.parent}: no {path.name} there; give the directory a run wrote")
    if not path.read_text(encoding="utf-8", errors="replace").endswith(END_LINE):
        raise UserError(f"{path} is cut short, or was not written by this fedlm (its last line should be "
                        f"'{END_LINE.strip()}'): resuming from it would train with defaults for what is missing; "
                        "restore the file the run wrote")
    return validate(read_yaml(path))


def holds_run(run_dir: Path) -> str | None:
    """What ``run_dir`` holds ('a finished run', 'an unfinished run', 'a grid of runs'), or None."""
    if (run_dir / "grid.yaml").is_file():
        return "a grid of runs"
    if not any((run_dir / name).exists() for name in RUN_FILES):
        return None
    return "a finished run" if (run_dir / "summary.md").is_file() else "an unfinished run"


def refuse_existing(run_dir: Path, overwrite: bool) -> None:
    """A new run may write to ``run_dir`` only if it holds no run, or if told to replace it."""
    held = holds_run(run_dir)
    if held is None or overwrite:
        return
    keep = ("see it with `fedlm report`" if held == "a finished run"
            else f"continue it with `fedlm run --resume {run_dir}`")
    raise UserError(f"{run_dir} already holds {held}; {keep}, give this run another name (name=NEW), or replace "
                    "it with --overwrite")


def clear_run(run_dir: Path) -> None:
    """Delete the run ``run_dir`` holds (called once the run replacing it has loaded its config, data and
    model); a directory without a run is left alone."""
    if holds_run(run_dir) is not None:
        shutil.rmtree(run_dir)


def run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories, with a grid directory standing for every run inside it; anything else is refused with
    one line naming it."""
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
