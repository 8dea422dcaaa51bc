"""A parsed source before it becomes a dataset (splits as column lists) and the helpers that the catalog,
local files and ``hf:`` sources share: deterministic splitting, typed field access, the column mapping and
the label encoding."""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlm.errors import UserError

log = logging.getLogger("fedlm")

Columns = dict[str, list[Any]]  # one split before it becomes a Dataset: column name -> values


@dataclass
class RawSource:
    """A parsed source before subsampling: splits as column lists plus provenance."""

    splits: dict[str, Columns]
    kind: str
    label_names: list[str] | None
    note: str
    files: list[Path]
    extra: dict[str, Any] = field(default_factory=dict)  # more of what determines the data (for the fingerprint)


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


def given_or_split(splits: dict[str, Columns], files: dict[str, Path], fraction: float, seed: int) -> str:
    """The test split as given (a test file beside train) or, without one, split off the training file in place;
    the note the run records of which it was."""
    if "test" in splits:
        return f"train/test = the given files ({', '.join(p.name for p in files.values())})"
    splits["train"], splits["test"] = split_off_test(splits["train"], fraction, seed, str(files["train"]))
    return split_note(fraction, seed, files["train"].name)


def field_of(path: Path | str, where: str, fields: dict[str, Any], key: str) -> Any:
    """A record's field, or an error naming the file, the line and the fields it has."""
    if key not in fields:
        raise UserError(f"{path} {where}: no '{key}' field (has: {', '.join(map(str, fields))})")
    return fields[key]


def text_of(path: Path | str, where: str, fields: dict[str, Any], key: str) -> str:
    """A record's field as text; numbers are accepted (a JSON id column), other values are errors."""
    value = field_of(path, where, fields, key)
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{path} {where}: field '{key}' should be text, found {type(value).__name__}")


# target: seq2seq output text; group: the silo an example comes from (a hospital, a site, an author), kept as the
# dataset's ``group`` column for natural partitions and the partition report; loaded only when mapped (a natural
# partition's column maps it, see config.ExperimentConfig), so a stray column of that name changes nothing
ROLES = ("text", "text_pair", "label", "target", "group")
_DEFAULT_COLUMNS = {"text": ("text", "sentence", "content"), "text_pair": ("text_pair",), "label": ("label",),
                    "target": ("target",)}


def group_only(columns: dict[str, str] | None) -> bool:
    """The mapping names a group column and nothing else: what a natural partition's column implies. Sources with
    columns of their own (named sources, tagged or QA files, documents, plain text) ignore it: the partition then
    finds its column among theirs (wikitext-2's group, SQuAD's title) or says which they have."""
    return bool(columns) and set(columns) == {"group"}


def map_columns(columns: dict[str, str] | None, available: list[str], what: object) -> dict[str, str]:
    """Our role -> the data's column, defaulting to same-named columns; unknown columns are errors."""
    mapping = dict(columns or {})
    if bad := [role for role in mapping if role not in ROLES]:
        raise UserError(f"unknown column role '{bad[0]}' in columns mapping; use {', '.join(ROLES)}")
    for role, names in _DEFAULT_COLUMNS.items():
        if role not in mapping and (hit := next((n for n in names if n in available), None)):
            mapping[role] = hit
    if "text" not in mapping:
        raise UserError(
            f"no text column in {what}; columns are: {', '.join(available)}; "
            "map one with columns={'text': ...}"
        )
    for role, column in mapping.items():
        if column not in available:
            raise UserError(
                f"column '{column}' (for {role}) not found in {what}; columns are: {', '.join(available)}"
            )
    return mapping


def group_value(what: object, where: str, column: str, value: Any) -> str:
    """A group name as text (a number or a bool names its group too); a missing or blank one is an error, since
    a row in no group would silently make a client of its own (or of all such rows)."""
    text = str(value).strip() if isinstance(value, str | int | float | bool) else ""
    if text and text.lower() != "nan":  # float NaN: pandas' missing value
        return text
    shown = f"a {type(value).__name__}" if isinstance(value, list | dict | tuple) else "missing"
    raise UserError(f"{what} {where}: the group (column '{column}') is {shown}; give every row a group name")


EMPTY_SHARE = 0.1  # this share of empty texts is worth a warning: they train and score as empty inputs


def warn_empty_texts(texts: list[str], what: object, column: str) -> None:
    """One warning line when many texts are empty (a wrong column, a broken export): they are kept, as a few
    empty rows are legitimate, but a tenth of the data saying nothing should not pass unnoticed."""
    empty = sum(1 for text in texts if not text.strip())
    if texts and empty >= EMPTY_SHARE * len(texts):
        log.warning("%s: %d of %d rows (%.0f%%) have an empty text in column '%s'; they train and score as empty "
                    "inputs: fill or drop them, or map another column as data.columns.text",
                    what, empty, len(texts), 100 * empty / len(texts), column)


def data_kind(mapped: dict[str, Any] | list[str], what: object) -> str | None:
    """'seq2seq' when a target column is mapped (checked against a label column), else None: labels decide."""
    if "target" not in mapped:
        return None
    if "label" in mapped:
        raise UserError(f"{what}: both a label and a target column are mapped; map label (classification) or "
                        "target (seq2seq), not both")
    return "seq2seq"


def check_target(what: object, where: str, value: str) -> str:
    """A seq2seq target, which must hold some text (nothing to learn or score otherwise)."""
    if not value.strip():
        raise UserError(f"{what} {where}: empty target; every seq2seq example needs target text (fix or drop it)")
    return value


def label_value(what: object, where: str, value: Any) -> str | float:
    """Numbers (or numeric strings) as float, anything else as a stripped string."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        if not math.isfinite(value):  # JSON NaN / Infinity: a missing label, never a class or a score
            raise UserError(f"{what} {where}: the label is {value}; give every row a class or a finite score")
        return float(value)
    if isinstance(value, str) and value.strip():
        try:
            number = float(value)
        except ValueError:
            return value.strip()
        return number if math.isfinite(number) else value.strip()
    raise UserError(f"{what} {where}: missing or empty label")


SPLIT_STEMS = {"train": ("train",), "test": ("test",), "validation": ("validation", "valid", "val", "dev", "devel")}


def named_split_files(folder: Path, suffixes: Iterable[str]) -> list[Path]:
    """The files of a directory named like a split (train.csv, test.jsonl, dev.txt ...) with one of ``suffixes``."""
    stems = {stem for names in SPLIT_STEMS.values() for stem in names}
    allowed = set(suffixes)
    return [p for p in sorted(folder.iterdir()) if p.stem in stems and p.suffix.lower() in allowed]


def split_files(folder: Path, suffixes: Iterable[str], expected: str) -> dict[str, Path]:
    """train.* (required), test.* and validation.*/valid.*/dev.* (optional) of a directory; ``expected`` completes
    the one line said when there is no train file ("expected train.json/.jsonl for task qa")."""
    named = named_split_files(folder, suffixes)
    found: dict[str, Path] = {}
    for split, stems in SPLIT_STEMS.items():
        matches = [p for p in named if p.stem in stems]
        if len(matches) > 1:
            raise UserError(f"{folder}: several {split} files ({', '.join(p.name for p in matches)}); keep one")
        if matches:
            found[split] = matches[0]
    if "train" not in found:
        raise UserError(f"{folder} has no train file: {expected}")
    return found

