"""Local files and directories (CSV, TSV, JSONL, JSON, plain text, read through ``datasets``' builders; Parquet
through pyarrow): column mapping, split files, and labels encoded as classes or kept as regression scores."""

from __future__ import annotations

from pathlib import Path

from fedlm.data.sources import builders, readers
from fedlm.data.sources.catalog import available_sources
from fedlm.data.sources.columns import (
    Columns,
    RawSource,
    check_target,
    data_kind,
    field_of,
    given_or_split,
    group_value,
    label_value,
    map_columns,
    named_split_files,
    split_files,
    text_of,
    warn_empty_texts,
)
from fedlm.data.sources.documents import document_files, load_documents
from fedlm.data.sources.labels import encode_labels
from fedlm.errors import UserError

FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".txt": "txt", ".parquet": "parquet"}


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


def _format(path: Path, file_format: str | None) -> str:
    fmt = (file_format or FORMATS.get(path.suffix.lower(), "")).lower().lstrip(".")
    fmt = "txt" if fmt == "text" else fmt
    if fmt not in FORMATS.values():
        raise UserError(
            f"cannot tell the format of {path}: set data.format to one of {', '.join(FORMATS.values())}"
        )
    return fmt


def _records(tabulate: builders.Tabulate, fmt: str, refs: list[str]) -> readers.Table:
    """Records of a structured file; CSV/TSV are headerless iff the mapping uses column indexes only."""
    columns, records = tabulate(True)
    if fmt in ("csv", "tsv") and refs and all(r.isdigit() for r in refs) and not all(r in columns for r in refs):
        return tabulate(False)
    return columns, records


def _columns(path: Path, tabulate: builders.Tabulate, fmt: str, columns: dict[str, str] | None) -> Columns:
    """The mapped columns of a file's records; labels as numbers or stripped names, not yet encoded."""
    available, records = _records(tabulate, fmt, list((columns or {}).values()))
    mapping = map_columns(columns, available, path)
    cols: Columns = {role: [] for role in mapping}
    if "label" in mapping:  # where each row is, for an error about its label (see labels.encode_labels)
        cols[WHERE] = [where for where, _ in records]
    for where, fields in records:
        for role, column in mapping.items():
            if role == "label":
                cols[role].append(label_value(path, where, field_of(path, where, fields, column)))
            elif role == "target":
                cols[role].append(check_target(path, where, text_of(path, where, fields, column)))
            elif role == "group":
                cols[role].append(group_value(path, where, column, field_of(path, where, fields, column)))
            else:
                cols[role].append(text_of(path, where, fields, column))
    warn_empty_texts(cols["text"], path, mapping["text"])
    return cols


WHERE = "where"  # a column of local files' rows: where each row is in its file, dropped once labels are read


def _encode(splits: dict[str, Columns], files: dict[str, Path], task: str | None,
            labels: str) -> tuple[str, list[str] | None]:
    """The data's kind and class names, from its labels (``labels``: where they are) when it has them."""
    wheres = {split: cols.pop(WHERE, None) for split, cols in splits.items()}
    if "label" not in splits["train"]:
        return "lm", None
    return encode_labels(splits, task, lambda split, i: f"{files[split]} {wheres[split][i]}", labels)


def _read_local_split(path: Path, fmt: str, columns: dict[str, str] | None) -> Columns:
    if fmt == "txt":
        if columns and set(columns) - {"text", "group"}:  # a group alone: a natural partition's, told of none
            raise UserError(f"{path} is plain text (one example per line): it has no columns to map")
        cols: Columns = {"text": builders.read_lines(path)}
    elif fmt == "parquet":
        table = readers.read_parquet(path)
        cols = _columns(path, lambda header: table, fmt, columns)
    else:
        cols = builders.read_table(path, fmt, lambda tabulate: _columns(path, tabulate, fmt, columns))
    if not cols["text"]:
        raise UserError(f"no examples in {path}: it has only blank lines (or only a header)")
    return cols


def load_local(
    path: Path, columns: dict[str, str] | None, file_format: str | None, fraction: float, seed: int,
    task: str | None = None,
) -> RawSource:
    """A local file, a directory of split files or of ``*.txt`` documents (``documents.py``); ``task`` (the
    config's) decides how labels are read."""
    if path.is_dir() and not named_split_files(path, FORMATS) and (docs := document_files(path)):
        return load_documents(path, docs, columns, fraction, seed)
    files = (split_files(path, FORMATS, "expected train.csv/.tsv/.jsonl/.json/.txt/.parquet beside its test file, "
                                          "or a directory of *.txt documents") if path.is_dir() else {"train": path})
    splits = {split: _read_local_split(p, _format(p, file_format), columns) for split, p in files.items()}
    if len({tuple(sorted(cols)) for cols in splits.values()}) > 1:
        raise UserError(f"{path}: the split files do not all have the same columns")
    if seq2seq := data_kind(splits["train"], path):
        kind, names = seq2seq, None
    else:
        where = path if len(files) > 1 else files["train"]
        kind, names = _encode(splits, files, task, f"{where} (label column '{(columns or {}).get('label', 'label')}')")
    return RawSource(splits, kind, names, given_or_split(splits, files, fraction, seed), list(files.values()))
