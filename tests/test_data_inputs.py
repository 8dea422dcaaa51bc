"""Issue 18: the partition input and its word statistics are columnar; labels decide the task only when they
clearly do (one log line says what was inferred, task: set explicitly wins); a directory of *.txt documents is
a corpus with a deterministic test split of whole documents."""

from __future__ import annotations

import contextlib
import json
import logging
import random
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml
from sklearn.feature_extraction.text import CountVectorizer

from fedlm.cli import main
from fedlm.config import validate
from fedlm.data.partition.words import client_vocab_sizes, word_matrix, words_per_text
from fedlm.data.sources import load_source
from fedlm.errors import UserError
from fedlm.run.prepare import prepare
from tests.conftest import make_sentences, tiny_config


def test_word_matrix_counts_the_words_count_vectorizer_counts() -> None:
    rng = random.Random(0)
    ascii_texts = ["".join(rng.choice("abcXYZ_-.,!? 12\t\n\x00") for _ in range(rng.randint(0, 30)))
                   for _ in range(3000)]
    unicode_texts = ["İstanbul ǅ naïve café ²³ 日本語", "नमस्ते दुनिया", "Straße STRASSE", "", "  !! "]
    texts = ascii_texts + unicode_texts + ascii_texts[:100]  # ASCII and non-ASCII batches, and repeats
    reference = CountVectorizer(token_pattern=r"(?u)\b\w+\b", lowercase=True).fit_transform(texts).tocsr()
    ours = word_matrix(texts)
    assert ours.shape == reference.shape
    assert np.array_equal(words_per_text(ours), np.asarray(reference.sum(axis=1)).ravel())
    assignment = np.random.default_rng(0).integers(-1, 7, len(texts))
    assert np.array_equal(client_vocab_sizes(assignment, 7, ours), client_vocab_sizes(assignment, 7, reference))
    assert word_matrix([]).shape == (0, 0) and word_matrix(["", "?!"]).nnz == 0


def test_partition_command_never_iterates_the_dataset_row_by_row(tmp_path: Path, monkeypatch, capsys) -> None:
    """Iterating a dataset column decodes one row at a time (93 s per million rows before issue 18)."""
    rows = ["text,label"] + [f"{text},{label}" for text, label in make_sentences(300)]
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    config = {"name": "p", "output_dir": str(tmp_path / "runs"), "data": {"source": str(tmp_path / "data.csv")},
              "partition": {"kind": "label_dirichlet", "alpha": 0.5, "num_clients": 5}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))

    def row_by_row(self):
        raise AssertionError("a dataset column was iterated row by row")

    monkeypatch.setattr(datasets.arrow_dataset.Column, "__iter__", row_by_row)
    assert main(["partition", str(tmp_path / "c.yaml")]) == 0
    summary = json.loads((tmp_path / "runs" / "p" / "partition" / "partition_summary.json").read_text())
    assert summary["num_examples"] == 270 and summary["statistics"]["vocab_size"]["max"] > 0


def _jsonl(path: Path, labels: list[object]) -> Path:
    path.write_text("".join(json.dumps({"text": f"text {i}", "label": v}) + "\n" for i, v in enumerate(labels)))
    return path


def test_the_inferred_task_is_logged_in_one_line(tmp_path: Path, caplog) -> None:
    """Issue 37: the way to regression is offered for numeric labels only, and one class is '1 class'."""
    def inferred(labels: list[object]) -> list[str]:
        caplog.clear()
        # one class is refused, after the line that says what was inferred
        with caplog.at_level(logging.INFO, logger="fedlm"), contextlib.suppress(UserError):
            load_source(str(_jsonl(tmp_path / "c.jsonl", labels)), tmp_path, task="auto")
        return [r.getMessage() for r in caplog.records if "inferred" in r.getMessage()]

    loaded = load_source(str(_jsonl(tmp_path / "c.jsonl", ["pos", "neg"] * 50)), tmp_path, task="auto")
    assert loaded.kind == "classification" and loaded.label_names == ["neg", "pos"]
    assert inferred(["pos", "neg"] * 50) == ["task inferred from the labels: classification, 2 classes (neg, pos)"]
    assert inferred([True, False] * 50) == ["task inferred from the labels: classification, 2 classes (false, true)"]
    assert inferred([1, 0, 2] * 50) == ["task inferred from the labels: classification, 3 classes (0, 1, 2); set "
                                        "task: regression to treat numeric labels as scores"]
    assert inferred(["pos"] * 50) == ["task inferred from the labels: classification, 1 class (pos)"]


def test_scores_with_many_fractions_are_regression(tmp_path: Path) -> None:
    scores = [round(i * 0.37 % 5, 2) for i in range(200)]
    assert load_source(str(_jsonl(tmp_path / "r.jsonl", scores)), tmp_path, task="auto").kind == "regression"


@pytest.mark.parametrize(("task", "kind", "names"), [
    ("classification", "classification", ["0", "0.5", "1"]),
    ("regression", "regression", None),
])
def test_an_explicit_task_wins_over_stray_values(tmp_path: Path, task: str, kind: str, names) -> None:
    labels = [0, 1] * 200
    labels[17] = 0.5
    loaded = load_source(str(_jsonl(tmp_path / "s.jsonl", labels)), tmp_path, task=task)
    assert (loaded.kind, loaded.label_names) == (kind, names)
    all_labels = np.concatenate([np.asarray(loaded.splits[s]["label"][:]) for s in ("train", "test")])
    assert sorted(set(all_labels.tolist())) == ([0, 1, 2] if kind == "classification" else [0.0, 0.5, 1.0])


def _corpus(root: Path, order: list[int]) -> Path:
    """12 documents in two folders (written in the given order), one blank, one hidden."""
    for i in order:
        folder = root / ("austen" if i % 2 else "dickens")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"doc{i:02d}.txt").write_text(f"Document {i}.\nIt has two lines, {i} words or so.\n")
    (root / "dickens" / "blank.txt").write_text("\n \n")
    (root / ".hidden.txt").write_text("not part of the corpus\n")
    return root


def test_a_directory_of_documents_is_a_corpus_split_by_whole_documents(tmp_path: Path) -> None:
    loaded = load_source(str(_corpus(tmp_path / "a", list(range(12)))), tmp_path, test_fraction=0.25, seed=3)
    train, test = loaded.splits["train"], loaded.splits["test"]
    assert loaded.kind == "lm" and (len(train), len(test)) == (9, 3)
    texts = train["text"][:] + test["text"][:]
    assert sorted(texts) == sorted(f"Document {i}.\nIt has two lines, {i} words or so." for i in range(12))
    assert set(train["group"][:] + test["group"][:]) == {"austen", "dickens"}
    assert "3 whole documents" in loaded.split_note and "1 blank left out" in loaded.split_note
    # the same files written in another order split the same way; another seed splits otherwise
    again = load_source(str(_corpus(tmp_path / "b", list(range(11, -1, -1)))), tmp_path, test_fraction=0.25, seed=3)
    assert again.splits["test"]["text"][:] == test["text"][:]
    other = load_source(str(tmp_path / "a"), tmp_path, test_fraction=0.25, seed=4)
    assert other.splits["test"]["text"][:] != test["text"][:]


def test_a_corpus_directory_partitions_by_folder(tmp_path: Path, capsys) -> None:
    config = {"name": "docs", "output_dir": str(tmp_path / "runs"), "seed": 1,
              "data": {"source": str(_corpus(tmp_path / "corpus", list(range(12)))), "test_fraction": 0.25},
              "partition": {"kind": "natural", "column": "group", "num_clients": 2}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["partition", str(tmp_path / "c.yaml")]) == 0
    assert "num_examples: 9" in capsys.readouterr().out


def test_a_long_tail_of_many_classes_is_not_stray(tmp_path: Path) -> None:
    """Many common classes (years, ids): a rare one is part of the data, not damage."""
    labels = [1950 + i % 40 for i in range(4000)] + [1900]
    loaded = load_source(str(_jsonl(tmp_path / "y.jsonl", labels)), tmp_path, task="auto")
    assert loaded.kind == "classification" and len(loaded.label_names) == 41


# ---------------------------------------------------------------------------------------------- issue 37


def _hospital_rows(n: int, hospitals: str = "ABC", seed: int = 0) -> list[dict]:
    return [{"note": text, "outcome": label, "hospital": hospitals[i % len(hospitals)]}
            for i, (text, label) in enumerate(make_sentences(n, seed))]


def _write_rows(path: Path, rows: list[dict]) -> Path:
    """CSV, JSON Lines or Parquet by the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        path.write_text("note,outcome,hospital\n" + "".join(f"{r['note']},{r['outcome']},{r['hospital']}\n"
                                                            for r in rows))
    return path


@pytest.mark.parametrize("source", ["data.csv", "data.jsonl", "data.parquet", "hf:folder"])
def test_a_natural_partition_on_a_users_own_column(tmp_path: Path, source: str) -> None:
    """Issue 37 item 1: partition.column names a column of the user's file (CSV, JSON Lines, Parquet, an hf:
    folder): it is loaded without a data.columns entry, each client is one hospital, and the partition report
    says which."""
    rows = _hospital_rows(90)
    if source == "hf:folder":
        _write_rows(tmp_path / "folder" / "train.parquet", rows)
        source = f"hf:{tmp_path / 'folder'}"
    else:
        source = str(_write_rows(tmp_path / source, rows))
    config = {"name": "h", "output_dir": str(tmp_path / "runs"),
              "data": {"source": source, "columns": {"text": "note", "label": "outcome"}},
              "partition": {"kind": "natural", "column": "hospital", "num_clients": 3}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["partition", str(tmp_path / "c.yaml")]) == 0
    report = tmp_path / "runs" / "h" / "partition"
    table = (report / "partition.csv").read_text().splitlines()
    assert table[0].endswith(",hospital") and [row.rsplit(",", 1)[1] for row in table[1:]] == ["A", "B", "C"]
    summary = json.loads((report / "partition_summary.json").read_text())
    assert summary["num_clients"] == 3 and summary["groups"]["hospital"]["values"] == 3


def test_partition_column_and_the_group_role_are_one_column(tmp_path: Path) -> None:
    """Issue 37 item 1: partition.column fills in data.columns.group (not written back: the dumped config is the
    one written and validates to the same), a written group role may be named either way, and two different
    columns are refused in one line."""
    data = {"source": "x.csv", "columns": {"text": "note"}}
    natural = {"kind": "natural", "column": "hospital", "num_clients": 3}
    config = validate({"data": data, "partition": natural})
    assert config.data.columns == {"text": "note", "group": "hospital"}
    dumped = config.model_dump(mode="json")
    assert dumped["data"]["columns"] == {"text": "note"}
    assert validate(dumped).data.columns == config.data.columns
    written = {**data, "columns": {"text": "note", "group": "hospital"}}
    for column in ("hospital", "group"):
        config = validate({"data": written, "partition": {**natural, "column": column}})
        assert config.data.columns == config.model_dump()["data"]["columns"] == written["columns"]
    with pytest.raises(UserError, match=r"^config error: partition.column is 'ward' but data.columns.group is "
                                        r"'hospital'"):
        validate({"data": written, "partition": {**natural, "column": "ward"}})
    assert validate({"data": data, "partition": {"kind": "iid"}}).data.columns == {"text": "note"}
    assert validate({"data": data, "partition": {**natural, "column": "group"}}).data.columns["group"] == "group"


def test_only_the_global_test_split_is_scored_without_local_evaluation(tmp_path: Path, one_thread) -> None:
    """Issue 37 item 7: eval.local false needs no client share of the test split, so none is made (here the
    test file lacks hospital B, which a natural partition of it refused); with eval.local each client's test
    share is its own hospital's, and B's client has none."""
    _write_rows(tmp_path / "d" / "train.csv", _hospital_rows(60))
    _write_rows(tmp_path / "d" / "test.csv", _hospital_rows(20, hospitals="AC", seed=1))
    raw = tiny_config(tmp_path, tmp_path / "d")
    raw["data"]["columns"] = {"text": "note", "label": "outcome"}
    raw["partition"] = {"kind": "natural", "column": "hospital", "num_clients": 3}
    raw["eval"]["local"] = False
    prep = prepare(validate(raw), tmp_path)
    assert prep.client_test == {} and len(prep.test_rows) == 20 and len(prep.client_train) == 3
    raw["eval"]["local"] = True
    prep = prepare(validate(raw), tmp_path)
    hospitals = prep.loaded.splits["test"]["group"][:]
    assert [len(prep.client_test[c]) for c in range(3)] == [hospitals.count("A"), 0, hospitals.count("C")]
