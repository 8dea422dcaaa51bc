"""One process per run directory: two `fedlm run` on one name (or a resume beside a live run, or --overwrite of
one) would interleave their rounds in one metrics.jsonl, or delete a run while it trains.

The lock is an exclusive ``flock`` on a file beside the run directory (``.NAME.lock``), so replacing the
directory (``--overwrite``) leaves it in place, and the operating system releases it when its process ends,
however it ends. The file names the holder's pid for the one line a second process stops with.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedlm.errors import UserError


def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.lock"


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir`` for this process while the block runs; another holder stops this one in one line."""
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise UserError(f"{run_dir} is in use by another fedlm process (pid {holder}); wait for it to end or "
                            "stop it: two processes writing one run would mix their rounds") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
