"""A parsed source before it becomes a dataset (splits as column lists) and the row helpers that the
catalog and the local-file loader share: deterministic splitting and typed field access."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlm.errors import UserError

Columns = dict[str, list[Any]]  # one split before it becomes a Dataset: column name -> values


@dataclass
class RawSource:
    """A parsed source before subsampling: splits as column lists plus provenance."""

    splits: dict[str, Columns]
    kind: str
    label_names: list[str] | None
    note: str
    files: list[Path]


def hash_order(n: int, seed: int, salt: str) -> list[int]:
    """Indices 0..n-1 in a seeded pseudo-random order that never depends on library versions."""

    def key(i: int) -> bytes:
        return hashlib.blake2b(f"{salt}:{seed}:{i}".encode(), digest_size=8).digest()

    return sorted(range(n), key=key)


def take(cols: Columns, idx: list[int]) -> Columns:
    """The rows ``idx`` of every column, in that order."""
    return {k: [v[i] for i in idx] for k, v in cols.items()}


def num_rows(cols: Columns) -> int:
    """Rows of a split; every source has a text column."""
    return len(cols["text"])


def split_off_test(cols: Columns, fraction: float, seed: int, what: str) -> tuple[Columns, Columns]:
    """Deterministic (train, test) split; both keep the original row order."""
    n = num_rows(cols)
    if n < 2:
        raise UserError(f"{what} has {n} example(s): too few to split off a test set")
    n_test = min(max(1, round(n * fraction)), n - 1)
    order = hash_order(n, seed, "test-split")
    return take(cols, sorted(order[n_test:])), take(cols, sorted(order[:n_test]))


def split_note(fraction: float, seed: int, of: str) -> str:
    """How :func:`split_off_test` made the test split, for the run's records."""
    return f"test = {fraction:.0%} of {of}, seed {seed}, deterministic (hash of seed and row index)"


def field_of(path: Path, where: str, fields: dict[str, Any], key: str) -> Any:
    """A record's field, or an error naming the file, the line and the fields it has."""
    if key not in fields:
        raise UserError(f"{path} {where}: no '{key}' field (has: {', '.join(map(str, fields))})")
    return fields[key]


def text_of(path: Path, where: str, fields: dict[str, Any], key: str) -> str:
    """A record's field as text; numbers are accepted (a JSON id column), other values are errors."""
    value = field_of(path, where, fields, key)
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{path} {where}: field '{key}' should be text, found {type(value).__name__}")
