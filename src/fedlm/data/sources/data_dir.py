"""Where the named datasets live, and how fedlm came to look there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from fedlm.errors import UserError

DEFAULT = "../shared/data"
# resolved data directory -> where it came from; filled by resolve_data_dir, read by describe_data_dir
_ORIGINS: dict[Path, str] = {}


def resolve_data_dir(cli_value: str | None = None) -> Path:
    """--data-dir, else $FEDLM_DATA_DIR, else a ``shared/data`` found next to the CWD or the repo, else the
    default ``../shared/data`` even though it does not exist: local files and ``hf:`` sources need no data
    directory, and a named dataset that does need one says where fedlm looked (:func:`describe_data_dir`)."""
    for origin, value in (("--data-dir", cli_value), ("FEDLM_DATA_DIR", os.environ.get("FEDLM_DATA_DIR"))):
        if value:
            path = Path(value).expanduser()
            if not path.is_dir():
                raise UserError(f"data directory {value} (from {origin}) does not exist")
            return _remember(path, f"from {origin}")
    for base, above in _search_roots():
        if (base / "shared" / "data").is_dir():
            return _remember(base / "shared" / "data", f"the default: the nearest shared/data above {above}")
    return _remember(
        Path.cwd().parent / "shared" / "data",
        f"the default {DEFAULT}; no shared/data above the working directory or the fedlm checkout either",
    )


def describe_data_dir(path: Path) -> str:
    """The data directory and where it came from, e.g. ``/data (from FEDLM_DATA_DIR)``."""
    path = Path(path)
    origin = _ORIGINS.get(path.resolve()) or "as given to fedlm"
    state = "" if path.is_dir() else ", which does not exist"
    return f"{path} ({origin}{state})"


def _remember(path: Path, origin: str) -> Path:
    path = path.resolve()
    _ORIGINS[path] = origin
    return path


def _search_roots() -> Iterator[tuple[Path, str]]:
    """../ of the CWD first (the documented layout), then every ancestor of the CWD and the package."""
    cwd = Path.cwd().resolve()
    for base in (cwd.parent, cwd, *cwd.parents):
        yield base, "the working directory"
    for base in Path(__file__).resolve().parents:
        yield base, "the fedlm checkout"
