"""Measurements taken in a fresh interpreter, so that imports and peak memory are that process's own: run a
child and read the JSON object it prints last, and read a process's memory counters."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def run_json_child(command: list[str], what: str, env: dict[str, str] | None = None) -> dict:
    """Runs ``command`` and returns the JSON object on the last line of its stdout; a failed child ends the
    benchmark with ``what`` and the tail of its stderr."""
    proc = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def status_kb(field: str) -> int:
    """One of this process's memory counters (VmRSS, VmHWM, ...) from /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")
