"""The hand-written readers: files as plain Python records.

Every reader returns ``(columns, records)`` where each record is ``(where, fields)``: ``where`` is a
human-readable location such as ``"line 17"`` so that later validation errors can point at the exact
spot.  All failures are raised as :class:`UserError` naming the file and line; no csv/json traceback
escapes from here.  Parquet files are read whole by pyarrow (which ``datasets`` brings), their rows numbered.

CSV, TSV, JSON Lines, JSON and plain text are read through ``datasets``' builders first (``builders.py``);
the readers for them stay because the builders cannot name the line of an error, and they read every file
whose builder output could differ from theirs.  The others read what no builder reads: WikiText headings,
PubTator documents, PubMedQA's object keyed by PMID.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from fedlm.errors import UserError

Record = tuple[str, dict[str, Any]]
Table = tuple[list[str], list[Record]]

# Default csv limit (128 KiB per field) is too small for long documents such as raw newsgroup posts.
csv.field_size_limit(2**31 - 1)

_WIKI_HEADING = re.compile(r"^ ?(= )+.*( =)+ ?$")


def read_text(path: Path) -> str:
    """Whole file as text (UTF-8, BOM dropped); a decode error names the line where it happens."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"data file not found: {path}") from None
    except OSError as e:
        raise UserError(f"cannot read data file {path}: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{path} line {line} is not valid UTF-8 ({e.reason}); save it as UTF-8") from None


def read_lines(path: Path) -> list[str]:
    """Lines without their terminators; splits on '\\n' only, because str.splitlines would also
    break on form feeds and Unicode separators that occur inside real text."""
    return [line.removesuffix("\r") for line in read_text(path).split("\n")]


Rows = list[tuple[str, list[str]]]  # the non-blank rows of a delimited file, header included: (where, fields)


def tabulate(path: Path, rows: Rows, header: bool) -> Table:
    """Check that every row has the same field count and key the fields by header name or index."""
    if not rows:
        raise UserError(f"{path} is empty: no rows found")
    if header:
        columns = [c.strip() for c in rows[0][1]]
        rows = rows[1:]
    else:
        columns = [str(i) for i in range(len(rows[0][1]))]
    width = len(columns)
    records: list[Record] = []
    for where, fields in rows:
        if len(fields) != width:
            raise UserError(
                f"{path} {where}: expected {width} fields, found {len(fields)}; "
                "check for a stray delimiter or an unclosed quote"
            )
        records.append((where, dict(zip(columns, fields, strict=True))))
    return columns, records


def tsv_rows(path: Path) -> Rows:
    """Tab-separated rows with no quoting (GLUE files contain bare '"' characters that a csv quote parser
    would treat as field delimiters and silently merge lines), each with its line; behind the csv builder,
    which names no line and pads a short row with empty fields."""
    return [(f"line {i}", line.split("\t")) for i, line in enumerate(read_lines(path), 1) if line.strip()]


def csv_rows(path: Path) -> Rows:
    """Comma-separated rows with standard double-quote quoting, each with the line it starts on; behind the
    csv builder, which names no line and pads a short row with empty fields."""
    reader = csv.reader(io.StringIO(read_text(path), newline=""))
    rows: Rows = []
    while True:
        start = reader.line_num + 1
        try:
            fields = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise UserError(f"bad CSV at {path} line {start}: {e}") from None
        if any(f.strip() for f in fields):
            rows.append((f"line {start}", fields))
    return rows


def _columns_of(records: list[Record]) -> list[str]:
    """Keys seen across all records, in first-seen order."""
    seen: dict[str, None] = {}
    for _, fields in records:
        seen.update(dict.fromkeys(fields))
    return list(seen)


def read_jsonl(path: Path) -> Table:
    """One JSON object per non-blank line; behind the json builder, which names no line and gives a missing
    key as null."""
    records: list[Record] = []
    for lineno, line in enumerate(read_lines(path), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"bad JSON at {path} line {lineno}: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{path} line {lineno}: expected a JSON object, found {type(obj).__name__}")
        records.append((f"line {lineno}", obj))
    return _columns_of(records), records


def load_json(path: Path) -> Any:
    """Parse a whole JSON document; the error names the line of the syntax error.  (PubMedQA's files are one
    object keyed by PMID, not rows: no builder reads them as records.)"""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise UserError(f"bad JSON at {path} line {e.lineno}: {e.msg} (column {e.colno})") from None


def read_json(path: Path) -> Table:
    """A JSON list of objects, or an object of equal-length lists (column-oriented, which the json builder
    reads as one row of lists)."""
    doc = load_json(path)
    if isinstance(doc, dict) and doc and all(isinstance(v, list) for v in doc.values()):
        lengths = {len(v) for v in doc.values()}
        if len(lengths) != 1:
            raise UserError(f"{path}: column lists have different lengths {sorted(lengths)}")
        keys = list(doc)
        doc = [dict(zip(keys, vals, strict=True)) for vals in zip(*doc.values(), strict=True)]
    if not isinstance(doc, list):
        raise UserError(f"{path}: expected a JSON list of objects or an object of column lists")
    records: list[Record] = []
    for i, obj in enumerate(doc, 1):
        if not isinstance(obj, dict):
            raise UserError(f"{path} record {i}: expected a JSON object, found {type(obj).__name__}")
        records.append((f"record {i}", obj))
    return _columns_of(records), records


def read_parquet(path: Path) -> Table:
    """The rows of a Parquet file as records (``row 1`` ...): columns are typed, so a number stays a number; an
    unreadable file is one line naming it."""
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise UserError(f"data file not found: {path}") from None
    except (pa.ArrowException, OSError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"cannot read {path} as Parquet ({reason}); check the file, or set data.format") from None
    columns = table.column_names
    if len(set(columns)) != len(columns):
        raise UserError(f"{path}: Parquet columns repeat a name ({', '.join(columns)}); give each column its own")
    rows = zip(*(table.column(i).to_pylist() for i in range(table.num_columns)), strict=True)
    return columns, [(f"row {i}", dict(zip(columns, values, strict=True))) for i, values in enumerate(rows, 1)]


def read_plain_text(path: Path) -> list[str]:
    """One example per non-empty line (trailing whitespace dropped); behind the text builder, whose decoding
    errors name no line."""
    return [line.rstrip() for line in read_lines(path) if line.strip()]


def read_wikitext(path: Path) -> tuple[list[str], list[str]]:
    """Paragraph lines of a WikiText token file and an id of the article each belongs to (no builder knows
    WikiText's headings, which mark articles and are not text).

    Headings (`` = Title = ``, `` = = Section = = ``) are dropped; only top-level ones start a new
    article.  Ids are "<article number> <title>" because a few titles occur twice in a file.
    """
    texts: list[str] = []
    groups: list[str] = []
    title, articles = "0000", 0
    for line in read_lines(path):
        stripped = line.strip()
        if not stripped:
            continue
        if _WIKI_HEADING.match(line):
            if not stripped.startswith("= ="):
                articles += 1
                title = f"{articles:04d} {stripped.strip('= ').strip()}"
            continue
        texts.append(stripped)
        groups.append(title)
    return texts, groups


def read_pubtator(path: Path) -> list[tuple[str, str]]:
    """(PMID, "title abstract") per document of a PubTator file (``PMID|t|``, ``PMID|a|`` lines;
    tab-separated mention lines are skipped).  Documents are kept in file order, duplicates included.
    No builder reads PubTator: a document spans several lines of different kinds."""
    docs: list[tuple[str, list[str]]] = []
    for lineno, line in enumerate(read_lines(path), 1):
        parts = line.split("|", 2)
        if len(parts) != 3 or parts[1] not in ("t", "a") or not parts[0].isdigit():
            continue
        pmid, kind, body = parts
        if kind == "t":
            docs.append((pmid, [body.strip()]))
        elif docs and docs[-1][0] == pmid:
            docs[-1][1].append(body.strip())
        else:
            raise UserError(f"{path} line {lineno}: abstract for PMID {pmid} does not follow its title line")
    return [(pmid, " ".join(p for p in parts if p)) for pmid, parts in docs]
