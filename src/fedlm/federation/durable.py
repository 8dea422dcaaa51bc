"""Files that are either whole or absent.

A checkpoint that a crash can tear is worse than none: it resumes silently wrong. Every file a run resumes
from is written aside, flushed to the disk, then renamed into place (an atomic step on POSIX file systems),
and the directory entry is flushed too, so a kill -9 or a power cut at any instant leaves the old file or
the new one, never a mix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` whose result appears at ``path`` whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (Exception, KeyboardInterrupt):  # a full disk, Ctrl-C, SIGTERM: the old file stays, alone
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Text whose file appears at ``path`` whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (Exception, KeyboardInterrupt):
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make renames and new entries in ``folder`` durable (POSIX; elsewhere a no-op)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
