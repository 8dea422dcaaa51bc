"""``hf:<dataset>[:<config>]`` sources: whatever ``datasets.load_dataset(dataset, config)`` returns (a hub
dataset, its copy in the Hugging Face cache, a local folder of data files (Parquet, CSV, JSON Lines ...) or one
such file), or a folder written by ``save_to_disk``, with the column mapping and label encoding of local files.

Which of the dataset's splits become fedlm's:

- train: the ``train`` split (or the only split there is);
- test: the ``test`` split if it has labels; else the ``validation`` split (also ``valid`` / ``dev``) if it
  has labels, since benchmarks such as GLUE publish their test split without labels (-1); else a
  deterministic share of train (``data.test_fraction``, as for a local file);
- validation: the validation split, kept as such when the test split is the dataset's own.

A split has labels when its label column is there, no value is missing (None, or -1 in a ``ClassLabel``
column) and not every value is -1.  Unlabeled text (no label column) takes ``test`` as it is; rows with
blank text are dropped from it (WikiText on the hub keeps its empty lines as rows).  ``split_note`` says
which rule applied.  ``ClassLabel`` columns give the label names; other label columns are encoded as in
local files (numbers with fractions: regression; otherwise sorted class names).
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import datasets
from datasets.exceptions import DatasetNotFoundError

from fedlm.data.sources.builders import local_reading
from fedlm.data.sources.columns import (
    Columns,
    RawSource,
    check_target,
    data_kind,
    group_value,
    label_value,
    map_columns,
    num_rows,
    split_note,
    split_off_test,
    warn_empty_texts,
)
from fedlm.data.sources.labels import check_classes, encode_labels
from fedlm.errors import UserError

PREFIX = "hf:"
_VALIDATION = ("validation", "valid", "dev")
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def parse_hub_source(source: str) -> tuple[str, str | None]:
    """``hf:<dataset>[:<config>]`` -> (dataset, config)."""
    name, _, config = source.removeprefix(PREFIX).partition(":")
    if not name.strip():
        raise UserError(f"data source '{source}' names no dataset: write hf:<dataset> or hf:<dataset>:<config>")
    return name.strip(), config.strip() or None


def load_hub(source: str, columns: dict[str, str] | None, fraction: float, seed: int,
             task: str | None = None) -> RawSource:
    name, config = parse_hub_source(source)
    dataset = _load(source, name, config)
    train_split = _train_split(source, dataset)
    train = dataset[train_split]
    mapping = map_columns(columns, train.column_names, source)
    label = mapping.get("label")
    feature = train.features[label] if label else None
    class_names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None

    chosen, notes = _choose_splits(dataset, train_split, label)
    splits = {ours: _columns(source, dataset[theirs], theirs, mapping, class_names) for ours, theirs in chosen.items()}
    if label is None:
        notes += _drop_blank_text(splits)
    if seq2seq := data_kind(mapping, source):
        kind, names = seq2seq, None
    elif label is None:
        kind, names = "lm", None
    elif class_names is not None:
        if task in (None, "auto", "classification"):
            check_classes(class_names, f"{source} (label column '{label}')", num_rows(splits["train"]))
        kind, names = "classification", class_names
    else:  # before a test split is carved out, so that an error's row numbers are the dataset's
        kind, names = encode_labels(splits, task, lambda split, i: f"{source} split '{chosen[split]}' row {i}",
                                    f"{source} (label column '{label}')")
    if "test" not in splits:
        splits["train"], splits["test"] = split_off_test(splits["train"], fraction, seed, f"{source} ({train_split})")
        notes.append(split_note(fraction, seed, f"split '{train_split}'"))
    if unused := [s for s in dataset if s not in chosen.values()]:
        notes.append(f"splits not used: {', '.join(unused)}")
    fingerprints = {s: getattr(dataset[s], "_fingerprint", None) for s in chosen.values()}
    extra = {"hub": {"name": name, "config": config, "fingerprints": fingerprints}}
    return RawSource(splits, kind, names, f"{source}: " + "; ".join(notes), [], extra)


def _load(source: str, name: str, config: str | None) -> datasets.DatasetDict:
    """The dataset's splits; every failure is one line naming the dataset and what to do."""
    folder = Path(name).expanduser()
    try:
        if folder.is_dir():
            loaded = _load_folder(source, folder, config)
        elif folder.is_file():
            loaded = _load_file(source, folder, config)
        elif name.startswith(("/", ".", "~")):
            raise UserError(f"{source}: no folder or file {folder}")
        else:
            if not datasets.config.HF_HUB_OFFLINE and (why := hub_unreachable()):
                raise UserError(f"{source}: cannot reach the Hugging Face hub ({why}) to load '{name}'; "
                                f"{_INSTEAD}, or set HF_HUB_OFFLINE=1 to load a copy already in the Hugging Face cache")
            loaded = datasets.load_dataset(name, config)
    except UserError:
        raise
    except Exception as e:  # datasets / huggingface_hub / fsspec errors of every kind
        raise UserError(_failure(source, name, config, e)) from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if not isinstance(loaded, datasets.DatasetDict) or not loaded:
        raise UserError(f"{source}: load_dataset gave {type(loaded).__name__}, not splits of a dataset")
    return loaded


_INSTEAD = "use a local file or folder as data.source"


def _load_folder(source: str, folder: Path, config: str | None) -> datasets.DatasetDict | datasets.Dataset:
    """A ``save_to_disk`` folder, or a folder of data files read by load_dataset (its builder output goes to
    a temporary cache, so that nothing piles up under ~/.cache/huggingface)."""
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        if config:
            raise UserError(f"{source}: {folder} was written by save_to_disk; it has no config '{config}'")
        return datasets.load_from_disk(str(folder), keep_in_memory=True)
    with tempfile.TemporaryDirectory(prefix="fedlm-hf-") as cache, local_reading():
        return datasets.load_dataset(str(folder.resolve()), config, cache_dir=cache, keep_in_memory=True)


# a data file's suffix -> the packaged builder of ``datasets`` that reads it
_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".txt": "text", ".arrow": "arrow"}


def _load_file(source: str, path: Path, config: str | None) -> datasets.Dataset | datasets.DatasetDict:
    """One data file, read by the builder its suffix names, as the train split (a test split is then carved out
    as for a local file)."""
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(f"{source}: load_dataset cannot tell how to read {path.name}; give a file ending in "
                        f"{', '.join(_BUILDERS)}, or a folder of them")
    if config:
        raise UserError(f"{source}: a single file has no config '{config}'; remove ':{config}'")
    with tempfile.TemporaryDirectory(prefix="fedlm-hf-") as cache, local_reading():
        return datasets.load_dataset(builder, data_files={"train": str(path.resolve())}, cache_dir=cache,
                                     keep_in_memory=True)


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub cannot be reached (a quick connection attempt), or None.  load_dataset itself retries
    for half a minute before it gives up; behind a proxy there is nothing to try, so this says None."""
    if any(os.environ.get(v) for v in _PROXIES):
        return None
    url = urlparse(datasets.config.HF_ENDPOINT)
    host = url.hostname or "huggingface.co"
    try:
        socket.create_connection((host, url.port or (80 if url.scheme == "http" else 443)), timeout).close()
    except OSError as e:
        return f"{host}: {e.strerror or e}"
    return None


def _failure(source: str, name: str, config: str | None, error: Exception) -> str:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    if datasets.config.HF_HUB_OFFLINE:
        return (f"{source}: cannot load '{name}' with HF_HUB_OFFLINE set ({reason}); it is not in the Hugging Face "
                f"cache: go online once to download it, or {_INSTEAD}")
    if isinstance(error, DatasetNotFoundError):
        return f"{source}: no dataset '{name}' on the Hugging Face hub, or no access to it ({reason}); {_INSTEAD}"
    if isinstance(error, ConnectionError):
        return (f"{source}: cannot reach the Hugging Face hub to load '{name}' ({reason}); {_INSTEAD}, "
                "or set HF_HUB_OFFLINE=1 to load a copy already in the Hugging Face cache")
    call = f"load_dataset('{name}'" + (f", '{config}')" if config else ")")
    return f"{source}: {call} failed: {type(error).__name__}: {reason}"


def _train_split(source: str, dataset: datasets.DatasetDict) -> str:
    if "train" in dataset:
        return "train"
    if len(dataset) == 1:
        return next(iter(dataset))
    raise UserError(f"{source}: no train split (splits: {', '.join(dataset)})")


def _has_labels(ds: datasets.Dataset, label: str) -> bool:
    if label not in ds.column_names:
        return False
    values = ds.select_columns([label]).to_dict()[label]
    if any(v is None for v in values):
        return False
    if isinstance(ds.features[label], datasets.ClassLabel) and any(v < 0 for v in values):
        return False
    return not (values and all(v == -1 for v in values))


def _choose_splits(dataset: datasets.DatasetDict, train: str, label: str | None) -> tuple[dict[str, str], list[str]]:
    """fedlm split -> the dataset's split, and the notes that say why."""
    chosen, notes = {"train": train}, [f"train = split '{train}'"]
    validation = next((s for s in _VALIDATION if s in dataset), None)
    usable = {s for s in dataset if label is None or _has_labels(dataset[s], label)}
    if "test" in usable:
        chosen["test"] = "test"
        notes.append("test = split 'test'")
        if validation in usable:
            chosen["validation"] = validation
            notes.append(f"validation = split '{validation}'")
        return chosen, notes
    why = "the test split has no labels" if "test" in dataset else "there is no test split"
    if validation in usable:
        chosen["test"] = validation
        notes.append(f"test = split '{validation}' ({why})")
    else:
        notes.append(f"{why}, nor a labelled validation split")
    return chosen, notes


def _columns(source: str, ds: datasets.Dataset, split: str, mapping: dict[str, str],
             class_names: list[str] | None) -> Columns:
    what = f"{source} ({split})"
    missing = [c for c in mapping.values() if c not in ds.column_names]
    if missing:
        raise UserError(f"{what}: no column '{missing[0]}'; columns are: {', '.join(ds.column_names)}")
    data = ds.select_columns(sorted(set(mapping.values()))).to_dict()
    cols: Columns = {}
    for role, column in mapping.items():
        values = data[column]
        if role == "target":
            cols[role] = [check_target(what, f"row {i}", _text(what, i, column, v)) for i, v in enumerate(values)]
        elif role == "group":
            feature = ds.features[column]
            if isinstance(feature, datasets.ClassLabel):  # the class names, not their ids
                values = [feature.int2str(v) if isinstance(v, int) and v >= 0 else None for v in values]
            cols[role] = [group_value(what, f"row {i}", column, v) for i, v in enumerate(values)]
        elif role != "label":
            cols[role] = [_text(what, i, column, v) for i, v in enumerate(values)]
        elif class_names is not None:
            bad = next((i for i, v in enumerate(values) if not isinstance(v, int) or v < 0), None)
            if bad is not None:
                raise UserError(f"{what} row {bad}: no label ({values[bad]!r} in column '{column}')")
            cols[role] = list(values)
        else:
            cols[role] = [label_value(what, f"row {i}", v) for i, v in enumerate(values)]
    if "label" in mapping:  # unlabeled text drops its blank rows (_drop_blank_text): nothing to warn of
        warn_empty_texts(cols["text"], what, mapping["text"])
    return cols


def _text(what: str, row: int, column: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{what} row {row}: column '{column}' should be text, found {type(value).__name__}")


def _drop_blank_text(splits: dict[str, Columns]) -> list[str]:
    notes = []
    for split, cols in splits.items():
        keep = [i for i, t in enumerate(cols["text"]) if t.strip()]
        if len(keep) < num_rows(cols):
            notes.append(f"{num_rows(cols) - len(keep)} blank rows dropped from {split}")
            splits[split] = {k: [v[i] for i in keep] for k, v in cols.items()}
    return notes
