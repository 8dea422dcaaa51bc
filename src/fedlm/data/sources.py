"""Named datasets from the shared data directory, and local files, as Hugging Face datasets.

Everything is parsed in Python and built with ``Dataset.from_dict`` (in memory), so loading takes
seconds, never touches the HF cache and works from a read-only data directory.  Splits that the raw
data does not provide are made deterministically by hashing ``(seed, row index)``, which is stable
across numpy/datasets versions and platforms; ``split_note`` records every such choice.

Returned columns: ``text``, optional ``text_pair``, ``label`` (``ClassLabel`` ints for
classification, float32 for regression, absent for LM corpora) and, for wikitext-2 only, ``group``
(article number + title).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from fedlm.data import readers
from fedlm.errors import UserError

Columns = dict[str, list[Any]]  # one split before it becomes a Dataset: column name -> values

_FINGERPRINT_VERSION = 1
_FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".txt": "txt"}
_ROLES = ("text", "text_pair", "label")
_DIR_SPLITS = {"train": ("train",), "test": ("test",), "validation": ("validation", "valid", "val", "dev")}


@dataclass(frozen=True)
class LoadedData:
    """A loaded source: splits plus what a caller needs to interpret and cache them."""

    splits: datasets.DatasetDict
    kind: str
    label_names: list[str] | None
    split_note: str
    fingerprint: str


@dataclass
class _Raw:
    """A parsed source before subsampling: splits as column lists plus provenance."""

    splits: dict[str, Columns]
    kind: str
    label_names: list[str] | None
    note: str
    files: list[Path]


# ---------------------------------------------------------------------------------------------- data dir


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


# ---------------------------------------------------------------------------------------------- helpers


def _hash_order(n: int, seed: int, salt: str) -> list[int]:
    """Indices 0..n-1 in a seeded pseudo-random order that never depends on library versions."""

    def key(i: int) -> bytes:
        return hashlib.blake2b(f"{salt}:{seed}:{i}".encode(), digest_size=8).digest()

    return sorted(range(n), key=key)


def _take(cols: Columns, idx: list[int]) -> Columns:
    return {k: [v[i] for i in idx] for k, v in cols.items()}


def _size(cols: Columns) -> int:
    return len(cols["text"])


def _split(cols: Columns, fraction: float, seed: int, what: str) -> tuple[Columns, Columns]:
    """Deterministic (train, test) split; both keep the original row order."""
    n = _size(cols)
    if n < 2:
        raise UserError(f"{what} has {n} example(s): too few to split off a test set")
    n_test = min(max(1, round(n * fraction)), n - 1)
    order = _hash_order(n, seed, "test-split")
    return _take(cols, sorted(order[n_test:])), _take(cols, sorted(order[:n_test]))


def _split_note(fraction: float, seed: int, of: str) -> str:
    return f"test = {fraction:.0%} of {of}, seed {seed}, deterministic (hash of seed and row index)"


def _require(path: Path, source: str) -> Path:
    if not path.is_file():
        raise UserError(f"missing data file {path} for source '{source}'; check --data-dir / FEDLM_DATA_DIR")
    return path


def _field(path: Path, where: str, fields: dict[str, Any], key: str) -> Any:
    if key not in fields:
        raise UserError(f"{path} {where}: no '{key}' field (has: {', '.join(map(str, fields))})")
    return fields[key]


def _text(path: Path, where: str, fields: dict[str, Any], key: str) -> str:
    value = _field(path, where, fields, key)
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{path} {where}: field '{key}' should be text, found {type(value).__name__}")


def _class_index(path: Path, where: str, value: str, names: list[str]) -> int:
    """A label given either by name or by its 0-based index."""
    value = value.strip()
    if value in names:
        return names.index(value)
    if value.isdigit() and int(value) < len(names):
        return int(value)
    raise UserError(f"{path} {where}: unknown label '{value}' (expected one of {', '.join(names)})")


def _float(path: Path, where: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise UserError(f"{path} {where}: score '{value}' is not a number") from None


# ---------------------------------------------------------------------------------------------- named


@dataclass(frozen=True)
class _Glue:
    folder: str
    header: bool
    text: str
    pair: str | None
    label: str
    names: list[str] | None  # None = regression


_GLUE = {
    "glue/cola": _Glue("CoLA", False, "3", None, "1", ["unacceptable", "acceptable"]),
    "glue/sst2": _Glue("SST-2", True, "sentence", None, "label", ["negative", "positive"]),
    "glue/mrpc": _Glue("MRPC", True, "#1 String", "#2 String", "Quality", ["not_equivalent", "equivalent"]),
    "glue/stsb": _Glue("STS-B", True, "sentence1", "sentence2", "score", None),
    "glue/qnli": _Glue("QNLI", True, "question", "sentence", "label", ["entailment", "not_entailment"]),
    "glue/rte": _Glue("RTE", True, "sentence1", "sentence2", "label", ["entailment", "not_entailment"]),
    "glue/wnli": _Glue("WNLI", True, "sentence1", "sentence2", "label", ["not_entailment", "entailment"]),
}


def _read_glue(path: Path, task: _Glue) -> Columns:
    _, records = readers.read_tsv(path, header=task.header)
    cols: Columns = {"text": [], "label": []} | ({"text_pair": []} if task.pair else {})
    for where, fields in records:
        cols["text"].append(_text(path, where, fields, task.text))
        if task.pair:
            cols["text_pair"].append(_text(path, where, fields, task.pair))
        raw = _field(path, where, fields, task.label)
        label = _float(path, where, raw) if task.names is None else _class_index(path, where, raw, task.names)
        cols["label"].append(label)
    return cols


def _load_glue(name: str, data_dir: Path, fraction: float, seed: int) -> _Raw:
    task = _GLUE[name]
    folder = data_dir / "glue" / task.folder
    dev_path = _require(folder / "dev.tsv", name)
    dev = _read_glue(dev_path, task)
    kind = "regression" if task.names is None else "classification"
    train_path = folder / "train.tsv"
    if name == "glue/qnli" and not train_path.is_file():
        train, test = _split(dev, fraction, seed, str(dev_path))
        note = (
            f"GLUE QNLI train is not available and GLUE test has no labels: train/test are made from "
            f"dev.tsv ({_size(dev)} rows); {_split_note(fraction, seed, 'dev')}"
        )
        return _Raw({"train": train, "test": test}, kind, task.names, note, [dev_path])
    train = _read_glue(_require(train_path, name), task)
    note = f"train = GLUE train.tsv; GLUE test has no labels, so dev.tsv ({_size(dev)} rows) is used as test"
    return _Raw({"train": train, "test": dev}, kind, task.names, note, [train_path, dev_path])


def _load_wikitext(data_dir: Path, fraction: float, seed: int) -> _Raw:
    splits: dict[str, Columns] = {}
    files = []
    for split, fname in (("train", "train.txt"), ("validation", "valid.txt"), ("test", "test.txt")):
        path = _require(data_dir / "wikitext-2" / fname, "wikitext-2")
        texts, groups = readers.read_wikitext(path)
        splits[split] = {"text": texts, "group": groups}
        files.append(path)
    note = (
        "train/validation/test = WikiText-2 train/valid/test.txt; one example per non-empty, "
        "non-heading line; group = article number + title"
    )
    return _Raw(splits, "lm", None, note, files)


def _load_ag_news(data_dir: Path, fraction: float, seed: int) -> _Raw:
    folder = data_dir / "ag_news"
    names = readers.read_plain_text(_require(folder / "classes.txt", "ag_news"))
    path = _require(folder / "test.csv", "ag_news")
    _, records = readers.read_csv(path, header=False)
    cols: Columns = {"text": [], "label": []}
    for where, fields in records:
        label = _field(path, where, fields, "0").strip()
        if not (label.isdigit() and 1 <= int(label) <= len(names)):
            raise UserError(f"{path} {where}: class index '{label}' is not in 1..{len(names)}")
        cols["text"].append(f"{_text(path, where, fields, '1')} {_text(path, where, fields, '2')}")
        cols["label"].append(int(label) - 1)
    train, test = _split(cols, fraction, seed, str(path))
    note = (
        f"only the official AG News test.csv ({_size(cols)} rows) is available: train/test are made from "
        f"it; {_split_note(fraction, seed, 'test.csv')}"
    )
    return _Raw({"train": train, "test": test}, "classification", names, note, [folder / "classes.txt", path])


def _load_20news(data_dir: Path, fraction: float, seed: int) -> _Raw:
    raw: dict[str, list[tuple[str, str]]] = {}
    files = []
    for split in ("train", "test"):
        path = _require(data_dir / "20newsgroups" / f"{split}.jsonl", "20newsgroups")
        _, records = readers.read_jsonl(path)
        raw[split] = [(_text(path, w, f, "text"), _text(path, w, f, "label")) for w, f in records]
        files.append(path)
    names = sorted({label for rows in raw.values() for _, label in rows})
    index = {n: i for i, n in enumerate(names)}
    splits = {
        s: {"text": [t for t, _ in rows], "label": [index[lab] for _, lab in rows]} for s, rows in raw.items()
    }
    note = "train/test = official 20news-bydate train/test; headers, footers and quotes kept"
    return _Raw(splits, "classification", names, note, files)


def _load_pubmed_abstracts(data_dir: Path, fraction: float, seed: int) -> _Raw:
    path = _require(data_dir / "pubmed-abstracts" / "PubMedAbstract_1MB.txt", "pubmed-abstracts")
    train, test = _split({"text": readers.read_plain_text(path)}, fraction, seed, str(path))
    return _Raw({"train": train, "test": test}, "lm", None, _split_note(fraction, seed, "the file"), [path])


_PQA_NAMES = ["yes", "no", "maybe"]


def _load_pubmedqa_rows(data_dir: Path, source: str) -> tuple[dict[str, Columns], list[Path]]:
    """PQA-L rows split by the official 500 test ids; columns text/text_pair/label."""
    main = _require(data_dir / "pubmedqa" / "ori_pqal.json", source)
    truth = _require(data_dir / "pubmedqa" / "test_ground_truth.json", source)
    data, test_ids = readers.load_json(main), readers.load_json(truth)
    if not isinstance(data, dict) or not isinstance(test_ids, dict):
        raise UserError(f"{main} / {truth}: expected JSON objects keyed by PMID")
    if missing := [pmid for pmid in test_ids if pmid not in data]:
        raise UserError(f"{truth}: test PMID {missing[0]} is not in {main}")
    splits: dict[str, Columns] = {s: {"text": [], "text_pair": [], "label": []} for s in ("train", "test")}
    for pmid, item in data.items():
        where = f"PMID {pmid}"
        contexts = _field(main, where, item, "CONTEXTS")
        decision = _field(main, where, item, "final_decision")
        if not isinstance(contexts, list) or decision not in _PQA_NAMES:
            raise UserError(f"{main} {where}: expected a CONTEXTS list and final_decision yes/no/maybe")
        cols = splits["test" if pmid in test_ids else "train"]
        cols["text"].append(_text(main, where, item, "QUESTION"))
        cols["text_pair"].append(" ".join(str(c).strip() for c in contexts))
        cols["label"].append(_PQA_NAMES.index(decision))
    return splits, [main, truth]


_PQA_NOTE = "test = the 500 official PQA-L test PMIDs (test_ground_truth.json), train = the other 500"


def _load_pubmedqa(data_dir: Path, fraction: float, seed: int) -> _Raw:
    splits, files = _load_pubmedqa_rows(data_dir, "pubmedqa")
    note = f"{_PQA_NOTE}; text = QUESTION, text_pair = joined CONTEXTS, label = final_decision"
    return _Raw(splits, "classification", list(_PQA_NAMES), note, files)


def _load_pubmedqa_contexts(data_dir: Path, fraction: float, seed: int) -> _Raw:
    splits, files = _load_pubmedqa_rows(data_dir, "pubmedqa-contexts")
    lm = {s: {"text": cols["text_pair"]} for s, cols in splits.items()}
    return _Raw(lm, "lm", None, f"{_PQA_NOTE} (same split as pubmedqa); text = joined CONTEXTS", files)


def _load_ncbi(data_dir: Path, fraction: float, seed: int) -> _Raw:
    splits: dict[str, Columns] = {}
    files = []
    for split, part in (("train", "train"), ("validation", "develop"), ("test", "test")):
        path = _require(data_dir / "ncbi-disease" / f"NCBI{part}set_corpus.txt", "ncbi-disease-abstracts")
        splits[split] = {"text": [text for _, text in readers.read_pubtator(path)]}
        files.append(path)
    note = "train/validation/test = NCBI train/develop/test corpus files; text = title + abstract"
    return _Raw(splits, "lm", None, note, files)


def _load_biomedical(data_dir: Path, fraction: float, seed: int) -> _Raw:
    """All staged biomedical abstracts (FDAPT's domain corpus): the three sources' train splits pooled for
    pre-training, their test splits for held-out MLM loss; pubmedqa's test contexts stay out of training."""
    parts = [_load_pubmed_abstracts(data_dir, fraction, seed), _load_pubmedqa_contexts(data_dir, fraction, seed),
             _load_ncbi(data_dir, fraction, seed)]
    splits = {s: {"text": [t for p in parts for t in p.splits[s]["text"]]} for s in ("train", "test")}
    note = "train/test = the train/test splits of pubmed-abstracts + pubmedqa-contexts + ncbi-disease-abstracts: "
    note += " | ".join(p.note for p in parts)
    return _Raw(splits, "lm", None, note, [f for p in parts for f in p.files])


_Loader = Callable[[Path, float, int], _Raw]
_SOURCES: dict[str, _Loader] = {
    "wikitext-2": _load_wikitext,
    **{name: partial(_load_glue, name) for name in _GLUE},
    "ag_news": _load_ag_news,
    "20newsgroups": _load_20news,
    "pubmed-abstracts": _load_pubmed_abstracts,
    "pubmedqa": _load_pubmedqa,
    "pubmedqa-contexts": _load_pubmedqa_contexts,
    "ncbi-disease-abstracts": _load_ncbi,
    "biomedical-abstracts": _load_biomedical,
}


def available_sources() -> list[str]:
    """Names accepted by :func:`load_source` besides file paths."""
    return sorted(_SOURCES)


# ---------------------------------------------------------------------------------------------- local


def _local_path(name: str, data_dir: Path) -> Path:
    """An existing file/dir (as given, or relative to the data dir), else a clear UserError."""
    if not name.strip():
        raise UserError("empty data source: give a source name or a file path")
    path = Path(name).expanduser()
    for candidate in (path, data_dir / path):
        if candidate.exists():
            return candidate.resolve()
    if path.suffix.lower() in _FORMATS:
        where = str(path) if path.is_absolute() else f"{Path.cwd() / path} or {data_dir / path}"
        raise UserError(f"data file not found: {where}")
    raise UserError(
        f"unknown data source '{name}' (and no such file); available: {', '.join(available_sources())}"
    )


def _dir_files(folder: Path) -> dict[str, Path]:
    """train.* (required), test.* and validation.*/valid.*/dev.* (optional) files of a directory."""
    found: dict[str, Path] = {}
    for split, stems in _DIR_SPLITS.items():
        matches = [p for p in sorted(folder.iterdir()) if p.stem in stems and p.suffix.lower() in _FORMATS]
        if len(matches) > 1:
            listed = ", ".join(p.name for p in matches)
            raise UserError(f"{folder}: several {split} files ({listed}); keep one")
        if matches:
            found[split] = matches[0]
    if "train" not in found:
        raise UserError(f"{folder} has no train file: expected train.csv/.tsv/.jsonl/.json/.txt")
    return found


def _format(path: Path, file_format: str | None) -> str:
    fmt = (file_format or _FORMATS.get(path.suffix.lower(), "")).lower().lstrip(".")
    fmt = "txt" if fmt == "text" else fmt
    if fmt not in _FORMATS.values():
        raise UserError(
            f"cannot tell the format of {path}: pass file_format as one of {', '.join(_FORMATS.values())}"
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
                    cols[role].append(_label_value(path, where, _field(path, where, fields, column)))
                else:
                    cols[role].append(_text(path, where, fields, column))
    if not cols["text"]:
        raise UserError(f"no examples in {path}: it has only blank lines (or only a header)")
    return cols


def _load_local(
    path: Path, columns: dict[str, str] | None, file_format: str | None, fraction: float, seed: int
) -> _Raw:
    files = _dir_files(path) if path.is_dir() else {"train": path}
    splits = {split: _read_local_split(p, _format(p, file_format), columns) for split, p in files.items()}
    if len({tuple(sorted(cols)) for cols in splits.values()}) > 1:
        raise UserError(f"{path}: the split files do not all have the same columns")
    kind, names = _encode_labels(splits) if "label" in splits["train"] else ("lm", None)
    if "test" in splits:
        note = f"train/test = the given files ({', '.join(p.name for p in files.values())})"
    else:
        splits["train"], splits["test"] = _split(splits["train"], fraction, seed, str(files["train"]))
        note = _split_note(fraction, seed, files["train"].name)
    return _Raw(splits, kind, names, note, list(files.values()))


# ---------------------------------------------------------------------------------------------- public


def _check_params(fraction: float, seed: int, limits: dict[str, int | None]) -> None:
    if not 0 < fraction < 1:
        raise UserError(f"test_fraction must be between 0 and 1 (exclusive), got {fraction}")
    if not isinstance(seed, int):
        raise UserError(f"seed must be an integer, got {seed!r}")
    for key, limit in limits.items():
        if limit is not None and limit < 1:
            raise UserError(f"{key} must be a positive integer, got {limit}")


def _subsample(raw: _Raw, seed: int, limits: dict[str, int | None]) -> str:
    """Cap split sizes in place (validation follows the test cap); returns the note to append."""
    notes = []
    for split, cols in raw.splits.items():
        limit = limits["max_train_examples" if split == "train" else "max_test_examples"]
        if limit is not None and _size(cols) > limit:
            keep = sorted(_hash_order(_size(cols), seed, f"subsample-{split}")[:limit])
            notes.append(f"{split} subsampled to {limit} of {_size(cols)} (seed {seed})")
            raw.splits[split] = _take(cols, keep)
    return "".join(f"; {n}" for n in notes)


def _to_dataset(cols: Columns, kind: str, names: list[str] | None, what: str) -> datasets.Dataset:
    features: dict[str, Any] = {"text": datasets.Value("string")}
    if "text_pair" in cols:
        features["text_pair"] = datasets.Value("string")
    if "label" in cols:
        features["label"] = (
            datasets.ClassLabel(names=names) if kind == "classification" else datasets.Value("float32")
        )
    if "group" in cols:
        features["group"] = datasets.Value("string")
    try:
        return datasets.Dataset.from_dict(
            {k: cols[k] for k in features}, features=datasets.Features(features)
        )
    except (pa.ArrowException, ValueError, TypeError) as e:  # e.g. lone surrogates in decoded JSON text
        raise UserError(f"{what}: cannot store the data as a dataset ({type(e).__name__}: {e})") from None


def _fingerprint(ident: str, files: list[Path], base: Path | None, params: dict[str, Any]) -> str:
    """Hash of what determines the result; files by (name, size, mtime) so edits invalidate caches."""
    stats = []
    for path in files:
        st = path.stat()
        shown = path.relative_to(base).as_posix() if base and path.is_relative_to(base) else str(path)
        stats.append([shown, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"v": _FINGERPRINT_VERSION, "source": ident, "files": stats, **params}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_source(
    name_or_path: str,
    data_dir: Path,
    *,
    columns: dict[str, str] | None = None,
    file_format: str | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
    max_train_examples: int | None = None,
    max_test_examples: int | None = None,
) -> LoadedData:
    """Load a named source (see :func:`available_sources`) or a local file/directory."""
    limits = {"max_train_examples": max_train_examples, "max_test_examples": max_test_examples}
    _check_params(test_fraction, seed, limits)
    data_dir = Path(data_dir)
    if name_or_path in _SOURCES:
        if columns or file_format:
            raise UserError(f"columns/file_format apply to local files only, not to source '{name_or_path}'")
        if not data_dir.is_dir():
            raise UserError(f"data directory {data_dir} does not exist; pass --data-dir or FEDLM_DATA_DIR")
        raw, ident, base = _SOURCES[name_or_path](data_dir, test_fraction, seed), name_or_path, data_dir
    else:
        path = _local_path(name_or_path, data_dir)
        raw, ident, base = _load_local(path, columns, file_format, test_fraction, seed), str(path), None
    note = raw.note + _subsample(raw, seed, limits)
    for split, cols in raw.splits.items():
        if not _size(cols):
            raise UserError(f"source '{name_or_path}': the {split} split is empty")
    order = [s for s in ("train", "validation", "test") if s in raw.splits]
    splits = datasets.DatasetDict(
        {s: _to_dataset(raw.splits[s], raw.kind, raw.label_names, f"{name_or_path} ({s})") for s in order}
    )
    params = {
        "columns": columns,
        "file_format": file_format,
        "test_fraction": test_fraction,
        "seed": seed,
        **limits,
    }
    return LoadedData(splits, raw.kind, raw.label_names, note, _fingerprint(ident, raw.files, base, params))
