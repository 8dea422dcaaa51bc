"""CSV, TSV, JSON Lines, JSON and plain-text files read through the packaged builders of ``datasets``
(``load_dataset("csv" | "json" | "text", data_files=...)``), with the hand readers of ``readers.py`` behind them.

A builder's output is used only where it is certainly what the hand reader would read; otherwise, and
whenever the caller rejects what the builder read (a :class:`UserError`), the hand reader reads the file
again, so that every error names its file and line as before (the builders report no line numbers).
CSV fields are all read as text (no type inference, no NA values); TSV, GLUE's files included, unquoted and
split on ``\n`` only, since GLUE has bare '"' in its text.  The cases that go to the hand reader:

- CSV / TSV: a row with an empty field (pandas pads a row that lacks fields with empty ones, so a short row
  cannot be told from a row with empty fields) and any parse error;
- JSON Lines / JSON: a column that is not all text, integers or booleans (Arrow turns a column mixing
  ints and floats into floats, so ``1`` could not be told from ``1.0``), a missing value (a missing key), a
  JSON document that is not a list of objects (a column-oriented object), and any parse error;
- text: a decoding error only.  One difference is kept: the text builder reads with universal newlines, so
  a lone carriage return ends a line (the hand reader split on ``\\n`` only).

Builders write Arrow files under ``cache_dir``: each read uses a temporary one, removed when the read
is done (the data is kept in memory), so nothing piles up under ``~/.cache/huggingface``; and no read goes
to the network (see :func:`local_reading`).
"""

from __future__ import annotations

import csv
import logging
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import datasets

from fedlm.data.sources import readers
from fedlm.data.sources.readers import Rows, Table
from fedlm.errors import UserError

T = TypeVar("T")
Tabulate = Callable[[bool], Table]  # header row? -> (columns, records); JSON files ignore the flag

# Arrow types whose Python values are exactly what the json module gives for the same JSON value.
_EXACT_JSON_TYPES = {"string", "large_string", "bool", "int64"}
_LIST_OF_OBJECTS = re.compile(rb"\s*\[\s*\{")


class _Miss(Exception):
    """The builder cannot stand in for the hand reader on this file."""


def read_table(path: Path, fmt: str, use: Callable[[Tabulate], T]) -> T:
    """``use`` applied to the records of a csv / tsv / jsonl / json file as the builder reads them, or as
    the hand reader does when the builder cannot be trusted with the file or ``use`` rejects its records."""
    try:
        tabulate = _builder_tabulate(path, fmt)
    except _Miss:
        tabulate = None
    if tabulate is not None:
        try:
            return use(tabulate)
        except UserError:
            pass  # the hand reader reads the file again, and its error names the line
    return use(_hand_tabulate(path, fmt))


def read_lines(path: Path) -> list[str]:
    """One example per non-empty line of a text file, trailing whitespace dropped (the text builder)."""
    try:
        lines = _load("text", path, encoding="utf-8-sig")[1]["text"]
    except _Miss:
        return readers.read_plain_text(path)  # names the line that is not UTF-8
    return [line.rstrip() for line in lines if line.strip()]


def _hand_tabulate(path: Path, fmt: str) -> Tabulate:
    if fmt in ("csv", "tsv"):
        rows = readers.csv_rows(path) if fmt == "csv" else readers.tsv_rows(path)
        return lambda header: readers.tabulate(path, rows, header)
    table = readers.read_jsonl(path) if fmt == "jsonl" else readers.read_json(path)
    return lambda header: table


def _builder_tabulate(path: Path, fmt: str) -> Tabulate:
    if fmt in ("csv", "tsv"):
        rows = _delimited_rows(path, fmt)
        return lambda header: readers.tabulate(path, rows, header)
    table = _json_table(path, fmt)
    return lambda header: table


@contextmanager
def local_reading() -> Iterator[None]:
    """While ``datasets`` reads a local file: no progress bars or logged errors (it takes a blink, and a file
    the builder cannot read goes to the hand reader, whose error is the one to show), and no network: for
    every load_dataset call ``datasets`` otherwise sends a request to count a download (3 s timeout)."""
    shown = not datasets.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL + 1)
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts
        datasets.logging.set_verbosity(verbosity)
        if shown:
            datasets.enable_progress_bars()


def _load(builder: str, path: Path, **config: Any) -> tuple[datasets.Features, dict[str, list[Any]]]:
    """The file as the builder reads it (types and columns); any failure is a miss (the hand reader decides)."""
    if any(c in str(path) for c in "*?[]{}"):
        raise _Miss  # data_files are glob patterns
    try:
        with tempfile.TemporaryDirectory(prefix="fedlm-builder-") as cache, local_reading():
            loaded = datasets.load_dataset(
                builder, data_files={"train": str(path)}, cache_dir=cache, keep_in_memory=True, **config
            )["train"]
            return loaded.features, loaded.to_dict()
    except Exception as e:  # pandas / pyarrow / datasets errors of every kind, invalid UTF-8 in Arrow strings
        raise _Miss from e


def _width(path: Path, fmt: str) -> int:
    """Fields of the first non-blank row, read as the hand reader reads it."""
    try:
        with path.open(encoding="utf-8-sig", newline="" if fmt == "csv" else "\n") as f:
            if fmt == "csv":
                rows = (r for r in csv.reader(f) if any(x.strip() for x in r))
            else:
                rows = (line.removesuffix("\n").removesuffix("\r").split("\t") for line in f if line.strip())
            return len(next(rows))
    except (OSError, UnicodeDecodeError, csv.Error, StopIteration):
        raise _Miss from None


def _delimited_rows(path: Path, fmt: str) -> Rows:
    """Non-blank rows through the csv builder: every field as text (no type inference, no NA values); TSV
    unquoted and split on ``\\n`` only, as GLUE's files need."""
    tsv = fmt == "tsv"
    names = [str(i) for i in range(_width(path, fmt))]
    _, columns = _load(
        "csv", path, sep="\t" if tsv else ",", header=None, column_names=names,
        features=datasets.Features({n: datasets.Value("string") for n in names}),
        na_filter=False, keep_default_na=False, encoding="utf-8-sig",
        quoting=csv.QUOTE_NONE if tsv else csv.QUOTE_MINIMAL, lineterminator="\n" if tsv else None,
    )
    cols = [columns[n] for n in names]
    if any(None in c for c in cols):
        raise _Miss
    if tsv:
        cols[-1] = [f.removesuffix("\r") for f in cols[-1]]
    # blank rows: the hand reader skips them too
    if blank := {i for i, f in enumerate(cols[0]) if not f.strip() and all(not c[i].strip() for c in cols)}:
        cols = [[f for i, f in enumerate(c) if i not in blank] for c in cols]
    if any("" in c for c in cols):
        raise _Miss  # maybe a short row that pandas padded with empty fields
    return [(f"row {i}", list(fields)) for i, fields in enumerate(zip(*cols, strict=True), 1)]


def _json_table(path: Path, fmt: str) -> Table:
    if fmt == "json":
        try:
            with path.open("rb") as f:
                head = f.read(256).removeprefix(b"\xef\xbb\xbf")
        except OSError:
            raise _Miss from None
        if not _LIST_OF_OBJECTS.match(head):
            raise _Miss  # an object of column lists, or a list of non-objects
    # on_mixed_types=None: a column whose type changes is an error (the hand reader), not JSON-encoded text
    features, columns = _load("json", path, on_mixed_types=None, parse_agent_traces=False)
    if any(not isinstance(f, datasets.Value) or f.dtype not in _EXACT_JSON_TYPES for f in features.values()):
        raise _Miss
    if any(None in values for values in columns.values()):
        raise _Miss  # a missing key or a null: the hand reader names the line
    names = list(columns)
    rows = zip(*columns.values(), strict=True)
    return names, [(f"record {i}", dict(zip(names, values, strict=True))) for i, values in enumerate(rows, 1)]
