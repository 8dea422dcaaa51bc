"""What a run ran on, in ``environment.json``: versions, threads, processes and device, once per stretch of rounds.

A run is reproducible from its config and seed on the same environment, not across environments: the number of
intra-op threads changes the order in which floating-point reductions add up, and training that sits on a loss
plateau for thousands of steps carries a last-digit difference into a different result (FedBERT's RoBERTa
Centralized ends one epoch at perplexity 577.0 on one thread and 573.1 on two, same code and seed; fedbert.md).
So a run records what it started on, each resume adds what it continued on, and a resume on different ground
says so in one line.
"""

from __future__ import annotations

import contextlib
import json
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers

import fedlm
from fedlm.federation.durable import write_text_atomic

ENVIRONMENT = "environment.json"
# What changes a run's numbers if it changes mid-run; versions of other libraries and the platform are recorded too.
BITWISE_KEYS = ("fedlm", "commit", "torch", "transformers", "threads", "processes", "device")


def describe(device: torch.device, processes: int) -> dict[str, Any]:
    """This process's environment as a run records it (``processes``: how many share each round's clients)."""
    return {"fedlm": fedlm.__version__, "commit": source_commit(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "threads": torch.get_num_threads(), "processes": processes,
            "device": device_name(device)}


def device_name(device: torch.device) -> str:
    """'cpu', or the accelerator's type and model ('cuda: NVIDIA H200'), which decides its kernels."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type


def source_commit() -> str | None:
    """The git commit fedlm runs from, '+dirty' when its source has uncommitted changes; None for an installed
    package outside a git checkout (or without git)."""
    here = Path(fedlm.__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = git("rev-parse", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--", ".") else "")
    return None


def record_environment(run_dir: Path, from_round: int, found: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Write ``found`` as the stretch that starts at ``from_round`` (round 1: a new run, any earlier record
    dropped; later: a resume, appended). Returns what differs from the run's first recorded stretch, as
    {key: (then, now)} over ``BITWISE_KEYS``: empty for a new run or one resumed where it began."""
    path = run_dir / ENVIRONMENT
    stretches = [s for s in read_stretches(run_dir) if s.get("from_round", 0) < from_round] if from_round > 1 else []
    first = stretches[0] if stretches else None
    stretches.append({"from_round": from_round, **found})
    write_text_atomic(path, json.dumps({"stretches": stretches}, indent=2) + "\n")  # a crash keeps the history
    if first is None:
        return {}
    return {key: (first.get(key), found.get(key)) for key in BITWISE_KEYS if first.get(key) != found.get(key)}


def read_stretches(run_dir: Path) -> list[dict[str, Any]]:
    """The stretches a run's environment.json records; none when it has no such file or an unreadable one (a run
    written before fedlm recorded its environment)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        stretches = json.loads((run_dir / ENVIRONMENT).read_text()).get("stretches", [])
        if isinstance(stretches, list) and all(isinstance(s, dict) for s in stretches):
            return stretches
    return []


def changed_line(name: str, from_round: int, changed: dict[str, tuple[Any, Any]]) -> str:
    """The warning a resume on different ground gives."""
    what = ", ".join(f"{key} {then} -> {now}" for key, (then, now) in changed.items())
    return (f"{name}: resumed at round {from_round} on another environment than the run began on ({what}; "
            f"{ENVIRONMENT}): rounds from {from_round} on are not bitwise those of an unbroken run")


def environment_note(run_dirs: Iterable[Path]) -> str:
    """A line for a comparison whose runs ran on different ground (any ``BITWISE_KEYS`` value that differs
    between their recorded stretches), naming the values; '' when they agree or record nothing."""
    seen: dict[str, set[str]] = {}
    for run_dir in run_dirs:
        for stretch in read_stretches(run_dir):
            for key in BITWISE_KEYS:
                seen.setdefault(key, set()).add(str(stretch.get(key)))
    differing = {key: values for key, values in seen.items() if len(values) > 1}
    if not differing:
        return ""
    what = "; ".join(f"{key}: {', '.join(sorted(values))}" for key, values in differing.items())
    return (f"Note: these runs ran on different environments, resumed stretches included ({what}; each run's "
            f"{ENVIRONMENT}), so their numbers differ in the last digits for that reason too, and long runs by more.\n")
