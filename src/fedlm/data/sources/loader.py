"""``load_source``: a named source, an ``hf:`` source or a local file as a Hugging Face ``DatasetDict``,
subsampled, with the provenance (split note, fingerprint) that runs and partition caches rely on."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from fedlm.data.sources import chat, conll, squad
from fedlm.data.sources.catalog import SOURCES, missing_data
from fedlm.data.sources.columns import Columns, RawSource, group_only, hash_order, num_rows, take
from fedlm.data.sources.hub import PREFIX, load_hub
from fedlm.data.sources.local import load_local, local_path
from fedlm.errors import UserError

_FINGERPRINT_VERSION = 1
# tasks whose local files have their own formats (a CoNLL .txt file is not one text per line, a chat row is a
# conversation)
TASK_READERS = {"tagging": conll.load_tagging, "qa": squad.load_qa, chat.KIND: chat.load_chat}


@dataclass(frozen=True)
class LoadedData:
    """A loaded source: splits plus what a caller needs to interpret and cache them."""

    splits: datasets.DatasetDict
    kind: str
    label_names: list[str] | None
    split_note: str
    fingerprint: str
    # the data's own name for the ``group`` column (data.columns.group, e.g. 'hospital'), by which a natural
    # partition may name it too; None when the data has no group column or calls it group
    group_column: str | None = None


def _check_params(fraction: float, seed: int, limits: dict[str, int | None]) -> None:
    if not 0 < fraction < 1:
        raise UserError(f"test_fraction must be between 0 and 1 (exclusive), got {fraction}")
    if not isinstance(seed, int):
        raise UserError(f"seed must be an integer, got {seed!r}")
    for key, limit in limits.items():
        if limit is not None and limit < 1:
            raise UserError(f"{key} must be a positive integer, got {limit}")


def _subsample(raw: RawSource, seed: int, limits: dict[str, int | None]) -> str:
    """Cap split sizes in place (validation follows the test cap); returns the note to append."""
    notes = []
    for split, cols in raw.splits.items():
        limit = limits["max_train_examples" if split == "train" else "max_test_examples"]
        if limit is not None and num_rows(cols) > limit:
            keep = sorted(hash_order(num_rows(cols), seed, f"subsample-{split}")[:limit])
            notes.append(f"{split} subsampled to {limit} of {num_rows(cols)} (seed {seed})")
            raw.splits[split] = take(cols, keep)
    return "".join(f"; {n}" for n in notes)


def _to_dataset(cols: Columns, kind: str, names: list[str] | None, what: str) -> datasets.Dataset:
    features: dict[str, Any] = {"text": datasets.Value("string")}
    if "text_pair" in cols:
        features["text_pair"] = datasets.Value("string")
    if "label" in cols:
        features["label"] = (
            datasets.ClassLabel(names=names) if kind == "classification" else datasets.Value("float32")
        )
    if "target" in cols:
        features["target"] = datasets.Value("string")
    if "group" in cols:
        features["group"] = datasets.Value("string")
    features.update({**conll.features(cols, names), **squad.features(cols)})
    try:
        return datasets.Dataset.from_dict(
            {k: cols[k] for k in features}, features=datasets.Features(features)
        )
    except (pa.ArrowException, ValueError, TypeError) as e:  # e.g. lone surrogates in decoded JSON text
        raise UserError(f"{what}: cannot store the data as a dataset ({type(e).__name__}: {e})") from None


def _fingerprint(ident: str, raw: RawSource, base: Path | None, params: dict[str, Any]) -> str:
    """Hash of what determines the result; files by (name, size, mtime) so edits invalidate caches, an
    ``hf:`` dataset by its name, config and the fingerprints ``datasets`` gives its splits."""
    stats = []
    for path in raw.files:
        st = path.stat()
        shown = path.relative_to(base).as_posix() if base and path.is_relative_to(base) else str(path)
        stats.append([shown, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"v": _FINGERPRINT_VERSION, "source": ident, "files": stats, **raw.extra, **params},
                      sort_keys=True)
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
    task: str | None = None,
) -> LoadedData:
    """Load a named source (see :func:`available_sources`), an ``hf:<dataset>[:<config>]`` source (see
    ``hub.py``) or a local file/directory; local files of ``task`` tagging or qa are read as CoNLL / tagged
    JSON Lines or as SQuAD JSON / JSON Lines (see :data:`TASK_READERS`)."""
    limits = {"max_train_examples": max_train_examples, "max_test_examples": max_test_examples}
    _check_params(test_fraction, seed, limits)
    data_dir = Path(data_dir)
    if name_or_path.startswith(PREFIX):
        if file_format:
            raise UserError(f"data.format applies to local files only, not to source '{name_or_path}': remove it")
        raw, ident, base = load_hub(name_or_path, columns, test_fraction, seed, task), name_or_path, None
    elif name_or_path in SOURCES:
        if group_only(columns):  # a natural partition's column: the named source's own columns hold it, or not
            columns = None
        if columns or file_format:
            raise UserError(f"data.columns and data.format apply to local files only, not to the named source "
                            f"'{name_or_path}': remove them")
        if not data_dir.is_dir():
            raise missing_data(name_or_path, data_dir)
        raw, ident, base = SOURCES[name_or_path](data_dir, test_fraction, seed), name_or_path, data_dir
    else:
        path = local_path(name_or_path, data_dir)
        if task in TASK_READERS and task != chat.KIND and group_only(columns):  # tagged / QA files: own columns
            columns = None
        reader = TASK_READERS.get(task or "", partial(load_local, task=task))
        raw, ident, base = reader(path, columns, file_format, test_fraction, seed), str(path), None
    note = raw.note + _subsample(raw, seed, limits)
    for split, cols in raw.splits.items():
        if not num_rows(cols):
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
        # the same file read by another reader, or its labels encoded for another task, is other data
        **({"task": task} if task in (*TASK_READERS, "classification", "regression") else {}),
    }
    group = (columns or {}).get("group")
    group_column = group if group != "group" and "group" in splits["train"].column_names else None
    return LoadedData(splits, raw.kind, raw.label_names, note, _fingerprint(ident, raw, base, params), group_column)
