"""Local files and directories (CSV, TSV, JSONL, JSON, plain text): column mapping, split files, and
labels encoded as classes or kept as regression scores."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedlm.data.sources import readers
from fedlm.data.sources.catalog import available_sources
from fedlm.data.sources.columns import Columns, RawSource, field_of, split_note, split_off_test, text_of
from fedlm.errors import UserError

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".txt": "txt"}
_ROLES = ("text", "text_pair", "label")
_DIR_SPLITS = {"train": ("train",), "test": ("test",), "validation": ("validation", "valid", "val", "dev")}


def local_path(name: str, data_dir: Path) -> Path:
    """An existing file/dir (as given, or relative to the data dir), else a clear UserError."""
    if not name.strip():
        raise UserError("empty data source: give a source name or a file path")
    path = Path(name).expanduser()
    for candidate in (path, data_dir / path):
        if candidate.exists():
            return candidate.resolve()
    if path.suffix.lower() in FORMATS:
        where = str(path) if path.is_absolute() else f"{Path.cwd() / path} or {data_dir / path}"
        raise UserError(f"data file not found: {where}")
    raise UserError(
        f"unknown data source '{name}' (and no such file); available: {', '.join(available_sources())}"
    )


def _dir_files(folder: Path) -> dict[str, Path]:
    """train.* (required), test.* and validation.*/valid.*/dev.* (optional) files of a directory."""
    found: dict[str, Path] = {}
    for split, stems in _DIR_SPLITS.items():
        matches = [p for p in sorted(folder.iterdir()) if p.stem in stems and p.suffix.lower() in FORMATS]
        if len(matches) > 1:
            listed = ", ".join(p.name for p in matches)
            raise UserError(f"{folder}: several {split} files ({listed}); keep one")
        if matches:
            found[split] = matches[0]
    if "train" not in found:
        raise UserError(f"{folder} has no train file: expected train.csv/.tsv/.jsonl/.json/.txt")
    return found


def _format(path: Path, file_format: str | None) -> str:
    fmt = (file_format or FORMATS.get(path.suffix.lower(), "")).lower().lstrip(".")
    fmt = "txt" if fmt == "text" else fmt
    if fmt not in FORMATS.values():
        raise UserError(
            f"cannot tell the format of {path}: pass file_format as one of {', '.join(FORMATS.values())}"
        )
    return fmt


def _read_table(path: Path, fmt: str, refs: list[str]) -> readers.Table:
    """Records of a structured file; CSV/TSV are headerless iff the mapping uses column indexes only."""
    if fmt == "jsonl":
        return readers.read_jsonl(path)
    if fmt == "json":
        return readers.read_json(path)
    read = readers.read_csv if fmt == "csv" else readers.read_tsv
    columns, records = read(path, header=True)
    if refs and all(r.isdigit() for r in refs) and not all(r in columns for r in refs):
        return read(path, header=False)
    return columns, records


def _mapping(columns: dict[str, str] | None, available: list[str], path: Path) -> dict[str, str]:
    """Our role -> the file's column, defaulting to same-named columns; unknown columns are errors."""
    mapping = dict(columns or {})
    if bad := [role for role in mapping if role not in _ROLES]:
        raise UserError(f"unknown column role '{bad[0]}' in columns mapping; use {', '.join(_ROLES)}")
    defaults = {"text": ("text", "sentence", "content"), "text_pair": ("text_pair",), "label": ("label",)}
    for role, names in defaults.items():
        if role not in mapping and (hit := next((n for n in names if n in available), None)):
            mapping[role] = hit
    if "text" not in mapping:
        raise UserError(
            f"no text column in {path}; columns are: {', '.join(available)}; "
            "map one with columns={'text': ...}"
        )
    for role, column in mapping.items():
        if column not in available:
            raise UserError(
                f"column '{column}' (for {role}) not found in {path}; columns are: {', '.join(available)}"
            )
    return mapping


def _label_value(path: Path, where: str, value: Any) -> str | float:
    """Numbers (or numeric strings) as float, anything else as a stripped string."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip():
        try:
            number = float(value)
        except ValueError:
            return value.strip()
        return number if math.isfinite(number) else value.strip()
    raise UserError(f"{path} {where}: missing or empty label")


def _encode_labels(splits: dict[str, Columns]) -> tuple[str, list[str] | None]:
    """Regression if every label is a number and some are fractional; else sorted class names."""
    values = [v for cols in splits.values() for v in cols["label"]]
    if all(isinstance(v, float) for v in values) and any(not v.is_integer() for v in values):
        return "regression", None

    def name(v: str | float) -> str:
        return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)

    distinct = {name(v): v for v in values}
    numeric = all(isinstance(v, float) for v in distinct.values())
    names = sorted(distinct, key=lambda n: (distinct[n], n) if numeric else (0, n))
    index = {n: i for i, n in enumerate(names)}
    for cols in splits.values():
        cols["label"] = [index[name(v)] for v in cols["label"]]
    return "classification", names


def _read_local_split(path: Path, fmt: str, columns: dict[str, str] | None) -> Columns:
    if fmt == "txt":
        if columns and set(columns) - {"text"}:
            raise UserError(f"{path} is plain text (one example per line): it has no columns to map")
        cols: Columns = {"text": readers.read_plain_text(path)}
    else:
        available, records = _read_table(path, fmt, list((columns or {}).values()))
        mapping = _mapping(columns, available, path)
        cols = {role: [] for role in mapping}
        for where, fields in records:
            for role, column in mapping.items():
                if role == "label":
                    cols[role].append(_label_value(path, where, field_of(path, where, fields, column)))
                else:
                    cols[role].append(text_of(path, where, fields, column))
    if not cols["text"]:
        raise UserError(f"no examples in {path}: it has only blank lines (or only a header)")
    return cols


def load_local(
    path: Path, columns: dict[str, str] | None, file_format: str | None, fraction: float, seed: int
) -> RawSource:
    files = _dir_files(path) if path.is_dir() else {"train": path}
    splits = {split: _read_local_split(p, _format(p, file_format), columns) for split, p in files.items()}
    if len({tuple(sorted(cols)) for cols in splits.values()}) > 1:
        raise UserError(f"{path}: the split files do not all have the same columns")
    kind, names = _encode_labels(splits) if "label" in splits["train"] else ("lm", None)
    if "test" in splits:
        note = f"train/test = the given files ({', '.join(p.name for p in files.values())})"
    else:
        splits["train"], splits["test"] = split_off_test(splits["train"], fraction, seed, str(files["train"]))
        note = split_note(fraction, seed, files["train"].name)
    return RawSource(splits, kind, names, note, list(files.values()))
