"""Sequence-tagging data: CoNLL column files and JSON Lines ``tokens`` / ``tags`` lists.

A tagged split is the columns ``tokens`` (a sentence's words), ``tags`` (one BIO/IOB2 tag per word, as
class ids into the tag set) and ``text`` (the words joined by spaces, for tokenizer training, clustered
partitions and statistics).  The tag set is read from the training split only, so a tag that appears
first in test data is an error that names it rather than a silent new class.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from fedlm.data.sources import readers
from fedlm.data.sources.columns import Columns, RawSource, hash_order, split_files, split_note, take
from fedlm.errors import UserError

CONLL_SUFFIXES = (".txt", ".tsv", ".conll")
TAGGING_SUFFIXES = (*CONLL_SUFFIXES, ".jsonl")
ROLES = ("tokens", "tags")
DOCSTART = "-DOCSTART-"
NO_ENTITY = "O (no entity)"  # the partition class of a sentence without entities
def _column_index(value: str, count: int, role: str, path: Path, where: str) -> int:
    """A configured CoNLL column (0-based, negative counts from the end) checked against the line's width."""
    try:
        index = int(value)
    except ValueError:
        raise UserError(f"{path}: the {role} column must be a column number (0-based, -1 = last), "
                        f"not {value!r}; set data.columns: {{{role}: N}}") from None
    if not -count <= index < count:
        raise UserError(f"{path} {where}: {role} column {index} does not exist: the lines have {count} columns "
                        f"(0..{count - 1}); set data.columns: {{{role}: N}} to one of them")
    return index % count


def read_conll(path: Path, columns: dict[str, str] | None = None) -> Columns:
    """Sentences of a CoNLL file: one token per line, columns split by tabs when the first token line has a
    tab (else by runs of spaces), blank lines between sentences, ``-DOCSTART-`` lines skipped.  The token
    is column 0 and the tag the last column unless ``columns`` maps ``tokens`` / ``tags`` to others; every
    token line must have as many columns as the first."""
    mapping = {"tokens": "0", "tags": "-1", **(columns or {})}
    sentences: Columns = {"tokens": [], "tags": []}
    words: list[str] = []
    tags: list[str] = []
    width = 0
    use_tabs = False
    token_at = tag_at = 0

    def close() -> None:
        if words:
            sentences["tokens"].append(list(words))
            sentences["tags"].append(list(tags))
            words.clear()
            tags.clear()

    for number, line in enumerate(readers.read_lines(path), start=1):
        if not line.strip():
            close()
            continue
        if not width:
            use_tabs = "\t" in line
        fields = line.split("\t") if use_tabs else line.split()
        if fields[0] == DOCSTART:
            close()
            continue
        where = f"line {number}"
        if not width:
            width = len(fields)
            if width < 2:
                raise UserError(f"{path} {where}: one column only; a CoNLL line needs a token and a tag column")
            token_at = _column_index(mapping["tokens"], width, "tokens", path, where)
            tag_at = _column_index(mapping["tags"], width, "tags", path, where)
        elif len(fields) != width:
            raise UserError(f"{path} {where}: {len(fields)} columns, but the first token line has {width}; "
                            f"every token line needs the same columns ({'tab' if use_tabs else 'space'}-separated)")
        words.append(fields[token_at])
        tags.append(fields[tag_at].strip())
    close()
    if not sentences["tokens"]:
        raise UserError(f"no sentences in {path}: expected CoNLL lines 'token ... tag' with blank lines between "
                        "sentences")
    return sentences


def read_tagged_jsonl(path: Path, columns: dict[str, str] | None = None) -> Columns:
    """Sentences of a JSON Lines file with a ``tokens`` and a ``tags`` list per line (other field names
    through ``columns``)."""
    mapping = {"tokens": "tokens", "tags": "tags", **(columns or {})}
    sentences: Columns = {"tokens": [], "tags": []}
    for where, fields in readers.read_jsonl(path)[1]:
        values = []
        for role in ROLES:
            key = mapping[role]
            if key not in fields:
                raise UserError(f"{path} {where}: no {key!r} field for the {role} (has: {', '.join(fields)}); "
                                f"map it with data.columns: {{{role}: FIELD}}")
            value = fields[key]
            if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                raise UserError(f"{path} {where}: field {key!r} should be a list of strings")
            values.append(value)
        tokens, tags = values
        if len(tokens) != len(tags):
            raise UserError(f"{path} {where}: {len(tokens)} tokens but {len(tags)} tags")
        if tokens:
            sentences["tokens"].append(tokens)
            sentences["tags"].append([tag.strip() for tag in tags])
    if not sentences["tokens"]:
        raise UserError(f"no sentences in {path}")
    return sentences


def read_tagged(path: Path, columns: dict[str, str] | None, file_format: str | None) -> Columns:
    """One tagged file by its format (``jsonl``, else CoNLL columns)."""
    if bad := [role for role in columns or {} if role not in ROLES]:
        raise UserError(f"column role {bad[0]!r} does not apply to tagging data; use tokens and tags")
    fmt = (file_format or path.suffix.lower().lstrip(".")).lower()
    return read_tagged_jsonl(path, columns) if fmt == "jsonl" else read_conll(path, columns)


def tagging_source(splits: dict[str, Columns], files: dict[str, Path], note: str,
                   tagset_from: tuple[str, ...] = ("train",)) -> RawSource:
    """Tagged splits as a source: tags become ids into the tag set of the ``tagset_from`` splits (the
    training split, or the whole file when fedlm split it: the tags of the user's data), O first."""
    used = {tag for split in tagset_from for tags in splits[split]["tags"] for tag in tags}
    names = sorted(used, key=lambda t: (t != "O", t[2:], t))
    index = {name: i for i, name in enumerate(names)}
    for split, cols in splits.items():
        for number, tags in enumerate(cols["tags"], start=1):
            if unseen := next((tag for tag in tags if tag not in index), None):
                raise UserError(f"{files[split]} sentence {number}: tag {unseen!r} does not occur in "
                                f"the training data (its tags: {', '.join(names)}); fix the tag or add training "
                                "examples of it")
        cols["tags"] = [[index[tag] for tag in tags] for tags in cols["tags"]]
        cols["text"] = [" ".join(tokens) for tokens in cols["tokens"]]
    return RawSource(splits, "tagging", names, note, list(files.values()))


def split_tagged(cols: Columns, fraction: float, seed: int, what: str) -> tuple[Columns, Columns]:
    """Deterministic (train, test) split of whole sentences (see ``columns.split_off_test``)."""
    n = len(cols["tokens"])
    if n < 2:
        raise UserError(f"{what} has {n} sentence(s): too few to split off a test set")
    n_test = min(max(1, round(n * fraction)), n - 1)
    order = hash_order(n, seed, "test-split")
    return take(cols, sorted(order[n_test:])), take(cols, sorted(order[:n_test]))


def load_tagging(
    path: Path, columns: dict[str, str] | None, file_format: str | None, fraction: float, seed: int
) -> RawSource:
    """A local tagged file, or a directory of train / dev / test files (.txt, .tsv, .conll or .jsonl)."""
    files = (split_files(path, TAGGING_SUFFIXES, "expected train.txt/.tsv/.conll/.jsonl for task tagging")
             if path.is_dir() else {"train": path})
    splits = {split: read_tagged(p, columns, file_format) for split, p in files.items()}
    if "test" in splits:
        note = f"train/test = the given files ({', '.join(p.name for p in files.values())})"
        return tagging_source(splits, files, note)
    splits["train"], splits["test"] = split_tagged(splits["train"], fraction, seed, str(files["train"]))
    note = split_note(fraction, seed, files["train"].name) + " (whole sentences)"
    return tagging_source(splits, {**files, "test": files["train"]}, note, tagset_from=("train", "test"))


def entity_type(tag: str) -> str | None:
    """``B-PER`` / ``I-PER`` -> ``PER``; ``O`` (or a bare tag) -> None."""
    return tag[2:] if tag[:2] in ("B-", "I-") else None


def sentence_entity_labels(tags: list[list[int]], names: list[str]) -> tuple[np.ndarray, list[str]]:
    """Each sentence's majority entity type, as one class per sentence (what label-skewed partitions use).

    Entities are counted, not tokens: a B- tag, or an I- tag that does not continue an entity of its type,
    starts one.  Ties go to the type first in alphabetical order; a sentence without entities is the class
    ``NO_ENTITY`` (class 0)."""
    types = sorted({t for name in names if (t := entity_type(name))})
    classes = {t: i + 1 for i, t in enumerate(types)}
    labels = np.zeros(len(tags), dtype=np.int64)
    for row, ids in enumerate(tags):
        counts: Counter[str] = Counter()
        previous = None
        for tag in (names[i] for i in ids):
            kind = entity_type(tag)
            if kind is not None and (tag.startswith("B-") or previous != kind):
                counts[kind] += 1
            previous = kind
        if counts:
            labels[row] = classes[min(counts, key=lambda t: (-counts[t], t))]
    return labels, [NO_ENTITY, *types]


def features(cols: Columns, names: list[str] | None) -> dict[str, Any]:
    """The dataset features of the tagging columns present in ``cols``."""
    if "tokens" not in cols:
        return {}
    return {"tokens": datasets.Sequence(datasets.Value("string")),
            "tags": datasets.Sequence(datasets.ClassLabel(names=names))}
