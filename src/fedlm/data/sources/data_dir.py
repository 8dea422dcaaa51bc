"""Where the named datasets live."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from fedlm.errors import UserError


def resolve_data_dir(cli_value: str | None = None) -> Path:
    """--data-dir, else $FEDLM_DATA_DIR, else a ``shared/data`` found next to the CWD or the repo."""
    for origin, value in (("--data-dir", cli_value), ("FEDLM_DATA_DIR", os.environ.get("FEDLM_DATA_DIR"))):
        if value:
            path = Path(value).expanduser()
            if not path.is_dir():
                raise UserError(f"data directory {value} (from {origin}) does not exist")
            return path.resolve()
    for base in _search_roots():
        if (base / "shared" / "data").is_dir():
            return (base / "shared" / "data").resolve()
    raise UserError(
        "no data directory found: pass --data-dir DIR or set FEDLM_DATA_DIR "
        "(searched for shared/data above the working directory and the fedlm checkout)"
    )


def _search_roots() -> Iterator[Path]:
    """../ of the CWD first (the documented layout), then every ancestor of the CWD and the package."""
    cwd = Path.cwd().resolve()
    yield cwd.parent
    yield from (cwd, *cwd.parents)
    yield from Path(__file__).resolve().parents
