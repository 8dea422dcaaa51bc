"""Tests for fedlm.data.sources: named sources against the shared data, local files, and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedlm.data.sources import LoadedData, available_sources, load_source, resolve_data_dir
from fedlm.errors import UserError

# name -> (kind, columns, number of labels, split sizes); sizes follow shared/data/MANIFEST.md.
EXPECTED = {
    "wikitext-2": ("lm", ["text", "group"], None, {"train": 17556, "validation": 1841, "test": 2185}),
    "glue/sst2": ("classification", ["text", "label"], 2, {"train": 67349, "test": 872}),
    "glue/cola": ("classification", ["text", "label"], 2, {"train": 8551, "test": 1043}),
    "glue/mrpc": ("classification", ["text", "text_pair", "label"], 2, {"train": 3668, "test": 408}),
    "glue/rte": ("classification", ["text", "text_pair", "label"], 2, {"train": 2490, "test": 277}),
    "glue/stsb": ("regression", ["text", "text_pair", "label"], None, {"train": 5749, "test": 1500}),
    "glue/wnli": ("classification", ["text", "text_pair", "label"], 2, {"train": 635, "test": 71}),
    "glue/qnli": ("classification", ["text", "text_pair", "label"], 2, {"train": 5463 - 546, "test": 546}),
    "ag_news": ("classification", ["text", "label"], 4, {"train": 7600 - 760, "test": 760}),
    "20newsgroups": ("classification", ["text", "label"], 20, {"train": 11314, "test": 7532}),
    "pubmed-abstracts": ("lm", ["text"], None, {"train": 725 - 72, "test": 72}),
    "pubmedqa": ("classification", ["text", "text_pair", "label"], 3, {"train": 500, "test": 500}),
    "pubmedqa-contexts": ("lm", ["text"], None, {"train": 500, "test": 500}),
    "ncbi-disease-abstracts": ("lm", ["text"], None, {"train": 593, "validation": 100, "test": 100}),
    "biomedical-abstracts": ("lm", ["text"], None, {"train": 653 + 500 + 593, "test": 72 + 500 + 100}),
    "conll2003": ("tagging", ["text", "tokens", "tags"], 9, {"train": 14041, "validation": 3250, "test": 3453}),
    "ncbi-disease": ("tagging", ["text", "tokens", "tags"], 3, {"train": 5432, "validation": 923, "test": 940}),
    "squad": ("qa", ["text", "text_pair", "id", "title", "answer_texts", "answer_starts"], None,
              {"train": 9713, "test": 857}),  # dev v1.1 split by article
    "dialogsum": ("seq2seq", ["text", "target", "group"], None, {"train": 12460, "validation": 500, "test": 500}),
}


@pytest.fixture(scope="module")
def data_dir() -> Path:
    try:
        return resolve_data_dir()
    except UserError:
        pytest.skip("shared data directory not found (set FEDLM_DATA_DIR)")


def test_available_sources_lists_every_named_source() -> None:
    assert available_sources() == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_source_shape(name: str, data_dir: Path) -> None:
    kind, columns, n_labels, sizes = EXPECTED[name]
    loaded = load_source(name, data_dir)
    assert loaded.kind == kind
    assert {s: d.num_rows for s, d in loaded.splits.items()} == sizes
    assert loaded.split_note
    assert len(loaded.fingerprint) == 16
    for split in loaded.splits.values():
        assert split.column_names == columns
        assert all(isinstance(t, str) and t for t in split["text"][:50])
    if n_labels is None:
        assert loaded.label_names is None
    else:
        assert len(loaded.label_names) == n_labels
        if kind == "tagging":  # every tag of the training split, each sentence's tags a list
            labels = {tag for split in ("train", "test") for tags in loaded.splits[split]["tags"] for tag in tags}
        else:
            labels = set(loaded.splits["train"]["label"]) | set(loaded.splits["test"]["label"])
        assert labels == set(range(n_labels))


def test_label_encodings_match_files(data_dir: Path) -> None:
    sst2 = load_source("glue/sst2", data_dir)
    assert sst2.label_names == ["negative", "positive"]
    assert sst2.splits["train"][0] == {"text": "hide new secretions from the parental units ", "label": 0}
    rte = load_source("glue/rte", data_dir)
    assert rte.label_names[rte.splits["train"][0]["label"]] == "not_entailment"
    wnli = load_source("glue/wnli", data_dir)
    assert wnli.label_names == ["not_entailment", "entailment"]
    assert wnli.splits["train"][0]["label"] == 1  # "The carrot had a hole." is entailed
    stsb = load_source("glue/stsb", data_dir).splits["train"]["label"]
    assert min(stsb) >= 0.0 and max(stsb) <= 5.0 and any(v != int(v) for v in stsb)
    ag = load_source("ag_news", data_dir)
    assert ag.label_names == ["World", "Sports", "Business", "Sci/Tech"]
    news = load_source("20newsgroups", data_dir)
    assert news.label_names == sorted(news.label_names) and news.label_names[0] == "alt.atheism"


def test_pubmedqa_test_set_is_official_ground_truth(data_dir: Path) -> None:
    truth = json.loads((data_dir / "pubmedqa" / "test_ground_truth.json").read_text())
    loaded = load_source("pubmedqa", data_dir)
    counts = {name: 0 for name in loaded.label_names}
    for label in loaded.splits["test"]["label"]:
        counts[loaded.label_names[label]] += 1
    assert counts == {name: list(truth.values()).count(name) for name in counts}
    contexts = load_source("pubmedqa-contexts", data_dir)
    assert contexts.splits["test"]["text"] == loaded.splits["test"]["text_pair"]


def test_wikitext_groups_are_articles(data_dir: Path) -> None:
    splits = load_source("wikitext-2", data_dir).splits
    assert {s: len(set(d["group"])) for s, d in splits.items()} == {
        "train": 629,
        "validation": 60,
        "test": 62,
    }
    assert not any(t.startswith("=") for t in splits["validation"]["text"])


def test_deterministic_split_and_seed(data_dir: Path) -> None:
    a = load_source("ag_news", data_dir, seed=0)
    b = load_source("ag_news", data_dir, seed=0)
    c = load_source("ag_news", data_dir, seed=1)
    assert a.splits["test"]["text"] == b.splits["test"]["text"]
    assert a.fingerprint == b.fingerprint
    assert a.splits["test"]["text"] != c.splits["test"]["text"]
    assert a.fingerprint != c.fingerprint
    assert set(a.splits["test"]["text"]).isdisjoint(a.splits["train"]["text"][:2000])
    assert "seed 0" in a.split_note and "10%" in a.split_note


def test_subsampling_is_deterministic(data_dir: Path) -> None:
    a = load_source("glue/sst2", data_dir, max_train_examples=100, max_test_examples=10)
    b = load_source("glue/sst2", data_dir, max_train_examples=100, max_test_examples=10)
    assert (a.splits["train"].num_rows, a.splits["test"].num_rows) == (100, 10)
    assert a.splits["train"]["text"] == b.splits["train"]["text"]
    assert "subsampled" in a.split_note
    assert a.fingerprint != load_source("glue/sst2", data_dir).fingerprint


# ---------------------------------------------------------------------------------------------- local


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_local_csv_with_mapping(tmp_path: Path) -> None:
    rows = "\n".join(f'"review {i}, with comma",{"pos" if i % 2 else "neg"},x' for i in range(20))
    path = _write(tmp_path / "reviews.csv", "body,sentiment,other\n" + rows + "\n")
    loaded = load_source(str(path), tmp_path, columns={"text": "body", "label": "sentiment"})
    assert loaded.kind == "classification" and loaded.label_names == ["neg", "pos"]
    assert loaded.splits["train"].column_names == ["text", "label"]
    assert (loaded.splits["train"].num_rows, loaded.splits["test"].num_rows) == (18, 2)
    assert "10%" in loaded.split_note and "seed 0" in loaded.split_note
    first = loaded.splits["train"][0]
    assert first == {"text": "review 0, with comma", "label": 0}


def test_local_tsv_header_and_headerless(tmp_path: Path) -> None:
    body = "".join(f'{i % 3}\tsay "hi {i}\tpair {i}\n' for i in range(10))
    headerless = _write(tmp_path / "plain.tsv", body)
    loaded = load_source(str(headerless), tmp_path, columns={"text": "1", "text_pair": "2", "label": "0"})
    assert loaded.label_names == ["0", "1", "2"]
    assert sum(d.num_rows for d in loaded.splits.values()) == 10
    assert loaded.splits["train"].column_names == ["text", "text_pair", "label"]
    with_header = _write(
        tmp_path / "h.tsv", "\ufefflabel\ttext\n" + "".join(f"{i}.5\tt{i}\n" for i in range(10))
    )
    loaded = load_source(str(with_header), tmp_path)
    assert loaded.kind == "regression" and loaded.label_names is None
    assert sorted([*loaded.splits["train"]["label"], *loaded.splits["test"]["label"]]) == [
        i + 0.5 for i in range(10)
    ]


def test_local_jsonl_json_and_txt(tmp_path: Path) -> None:
    lines = [json.dumps({"q": f"question {i}", "y": i % 2 == 0, "id": i}) for i in range(10)]
    jsonl = _write(tmp_path / "a.jsonl", "\n".join(lines) + "\n\n")
    loaded = load_source(str(jsonl), tmp_path, columns={"text": "q", "label": "y"})
    assert loaded.label_names == ["false", "true"] and loaded.splits["test"].num_rows == 1
    records = [{"text": f"doc {i}", "label": 10 - i} for i in range(12)]
    as_json = _write(tmp_path / "b.json", json.dumps(records))
    loaded = load_source(str(as_json), tmp_path, test_fraction=0.25, seed=3)
    assert loaded.label_names == [str(i) for i in range(-1, 11)]  # numeric order: 2 before 10
    assert loaded.splits["test"].num_rows == 3
    txt = _write(tmp_path / "corpus.txt", "first line\n\n  \nsecond line\nthird\n")
    loaded = load_source(str(txt), tmp_path, test_fraction=0.34)
    assert loaded.kind == "lm" and loaded.splits["train"].column_names == ["text"]
    assert sorted([*loaded.splits["train"]["text"], *loaded.splits["test"]["text"]]) == [
        "first line",
        "second line",
        "third",
    ]


def test_local_directory_with_train_and_test(tmp_path: Path) -> None:
    _write(tmp_path / "train.csv", "text,label\n" + "".join(f"t{i},{'ab'[i % 2]}\n" for i in range(8)))
    _write(tmp_path / "test.csv", "text,label\nu1,c\nu2,a\n")
    loaded = load_source(str(tmp_path), tmp_path)
    assert loaded.label_names == ["a", "b", "c"]
    assert {s: d.num_rows for s, d in loaded.splits.items()} == {"train": 8, "test": 2}
    assert loaded.splits["test"]["label"] == [2, 0]
    assert "train.csv" in loaded.split_note


def test_local_relative_to_data_dir_and_fingerprint_tracks_edits(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.txt", "one\ntwo\nthree\n")
    first = load_source("c.txt", tmp_path)
    assert first.fingerprint == load_source(str(path), tmp_path).fingerprint
    _write(path, "one\ntwo\nthree\nfour\n")
    assert load_source(str(path), tmp_path).fingerprint != first.fingerprint


# ---------------------------------------------------------------------------------------------- errors


def _error(*args: object, **kwargs: object) -> str:
    with pytest.raises(UserError) as info:
        load_source(*args, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_file(tmp_path: Path) -> None:
    assert "nope.csv" in _error(str(tmp_path / "nope.csv"), tmp_path)


def test_unknown_source_lists_available(tmp_path: Path) -> None:
    message = _error("glue/mnli", tmp_path)
    assert "glue/mnli" in message and "glue/sst2" in message and "wikitext-2" in message


def test_missing_column_names_it_and_lists_columns(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.csv", "body,sentiment\nx,1\ny,0\n")
    message = _error(str(path), tmp_path, columns={"text": "body", "label": "stars"})
    assert "'stars'" in message and "body, sentiment" in message and str(path) in message
    assert "text" in _error(str(path), tmp_path)  # no text column and no mapping


def test_bad_json_line_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.jsonl", '{"text": "ok"}\n\n{"text": "bad",, }\n')
    message = _error(str(path), tmp_path)
    assert f"bad JSON at {path} line 3" in message
    whole = _write(tmp_path / "b.json", '[\n{"text": "a"},\n{"text": }\n]')
    assert f"{whole} line 3" in _error(str(whole), tmp_path)


def test_malformed_rows_are_named(tmp_path: Path) -> None:
    tsv = _write(tmp_path / "a.tsv", "text\tlabel\na\t1\nb\t0\textra\n")
    assert f"{tsv} line 3" in _error(str(tsv), tmp_path)
    csv_path = _write(tmp_path / "a.csv", 'text,label\na,1\n"b,0\n')
    assert str(csv_path) in _error(str(csv_path), tmp_path)
    no_label = _write(tmp_path / "b.csv", "text,label\na,1\nb,\n")
    assert f"{no_label} line 3" in _error(str(no_label), tmp_path)
    no_key = _write(tmp_path / "c.jsonl", '{"text": "a", "label": 1}\n{"text": "b"}\n')
    assert f"{no_key} line 2" in _error(str(no_key), tmp_path)


def test_empty_inputs(tmp_path: Path) -> None:
    for name in ("e.txt", "e.csv", "e.jsonl"):
        path = _write(tmp_path / name, "\n \n")
        assert str(path) in _error(str(path), tmp_path)
    header_only = _write(tmp_path / "h.csv", "text,label\n")
    assert str(header_only) in _error(str(header_only), tmp_path)


def test_named_source_with_missing_files(tmp_path: Path) -> None:
    message = _error("glue/sst2", tmp_path)
    assert str(tmp_path / "glue" / "SST-2") in message


def test_bad_parameters(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.txt", "one\ntwo\n")
    assert "test_fraction" in _error(str(path), tmp_path, test_fraction=1.5)
    assert "max_train_examples" in _error(str(path), tmp_path, max_train_examples=0)
    assert "set data.format to one of" in _error(str(path), tmp_path, file_format="xml")
    assert "local files" in _error("glue/sst2", tmp_path, columns={"text": "x"})


def test_resolve_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "repo" / "sub").mkdir(parents=True)
    monkeypatch.delenv("FEDLM_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path / "repo" / "sub")
    assert resolve_data_dir() == (tmp_path / "shared" / "data").resolve()
    monkeypatch.setenv("FEDLM_DATA_DIR", str(tmp_path / "repo"))
    assert resolve_data_dir() == (tmp_path / "repo").resolve()
    assert resolve_data_dir(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(UserError, match="does not exist"):
        resolve_data_dir(str(tmp_path / "missing"))


def test_loaded_data_is_frozen(tmp_path: Path) -> None:
    loaded = load_source(str(_write(tmp_path / "c.txt", "a\nb\n")), tmp_path)
    assert isinstance(loaded, LoadedData)
    with pytest.raises(AttributeError):
        loaded.kind = "x"  # type: ignore[misc]


def test_short_rows_are_named_though_the_builder_pads_them(tmp_path: Path) -> None:
    short = _write(tmp_path / "s.csv", "text,label,id\na,1,x\nb,0\nc,1,z\n")
    assert f"{short} line 3: expected 3 fields, found 2" in _error(str(short), tmp_path)
    short_tsv = _write(tmp_path / "s.tsv", "text\tlabel\tid\na\t1\tx\nb\t0\n")
    assert f"{short_tsv} line 3: expected 3 fields, found 2" in _error(str(short_tsv), tmp_path)


# ---------------------------------------------------------------------------------------------- builders

BUILDER_FILES = {
    "q.csv": ('\ufefftext , label\r\n"multi\nline, quoted",007\r\n  ,  \r\nNA,null\r\n"x""q",1e3\r\n', "csv"),
    "glue.tsv": ('sentence\tlabel\nit \'s "quoted\t1\r\n\t\nplain " text\t0\n', "tsv"),
    "r.jsonl": ('{"text": "a\\u00e9", "label": 1, "ok": true}\n\n{"text": "b", "label": 20, "ok": false}\n', "jsonl"),
    "r.json": ('[{"text": "a", "label": "x"}, {"text": "b", "label": "y"}]', "json"),
}


@pytest.mark.parametrize("name", sorted(BUILDER_FILES))
def test_builders_read_what_the_hand_readers_read(name: str, tmp_path: Path) -> None:
    from fedlm.data.sources import builders

    text, fmt = BUILDER_FILES[name]
    path = tmp_path / name
    path.write_text(text, encoding="utf-8", newline="")
    by_builder = builders._builder_tabulate(path, fmt)  # the builder path is taken, not the fallback
    by_hand = builders._hand_tabulate(path, fmt)
    for header in (True, False) if fmt in ("csv", "tsv") else (True,):
        (columns, records), (hand_columns, hand_records) = by_builder(header), by_hand(header)
        assert columns == hand_columns
        assert [fields for _, fields in records] == [fields for _, fields in hand_records]


def test_text_through_the_builder(tmp_path: Path) -> None:
    from fedlm.data.sources import builders, readers

    path = _write(tmp_path / "t.txt", "\ufeffone \n\n  \ntwo\x0cthree\u2028four\r\nfive\n")
    assert builders.read_lines(path) == readers.read_plain_text(path) == ["one", "two\x0cthree\u2028four", "five"]


def test_local_loads_stay_offline_and_leave_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import tempfile

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("a local file was read over the network")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "train.csv", "text,label\n" + "".join(f"t{i},{i % 2}\n" for i in range(10)))
    _write(data / "test.jsonl", "".join(json.dumps({"text": f"u{i}", "label": i % 2}) + "\n" for i in range(4)))
    loaded = load_source(str(data), tmp_path)
    assert {s: d.num_rows for s, d in loaded.splits.items()} == {"train": 10, "test": 4}
    assert list(scratch.iterdir()) == []


# ---------------------------------------------------------------------------------------------- hf:


def _hf_folder(root: Path) -> Path:
    folder = root / "mydata"
    folder.mkdir()
    _write(folder / "train.csv", "review,stars\n" + "".join(f"good {i},{'ab'[i % 2]}\n" for i in range(12)))
    _write(folder / "test.csv", "review,stars\nfine,b\nbad,a\nok,c\n")
    return folder


def test_hf_local_folder_maps_like_a_local_directory(tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path)
    columns = {"text": "review", "label": "stars"}
    hub = load_source(f"hf:{folder}", tmp_path, columns=columns)
    local = load_source(str(folder), tmp_path, columns=columns)
    assert (hub.kind, hub.label_names) == (local.kind, local.label_names) == ("classification", ["a", "b", "c"])
    for split in ("train", "test"):
        assert hub.splits[split].to_dict() == local.splits[split].to_dict()
        assert hub.splits[split].features == local.splits[split].features
    assert "test = split 'test'" in hub.split_note
    assert hub.fingerprint == load_source(f"hf:{folder}", tmp_path, columns=columns).fingerprint
    assert hub.fingerprint != load_source(f"hf:{folder}", tmp_path, columns=columns, seed=1).fingerprint
    _write(folder / "test.csv", "review,stars\nfine,b\nbad,a\n")
    assert load_source(f"hf:{folder}", tmp_path, columns=columns).fingerprint != hub.fingerprint
    assert "no text column" in _error(f"hf:{folder}", tmp_path)
    assert "data.format applies to local files only" in _error(f"hf:{folder}", tmp_path, file_format="csv")


def _glue_like(root: Path) -> Path:
    import datasets

    features = datasets.Features(
        {
            "sentence1": datasets.Value("string"),
            "sentence2": datasets.Value("string"),
            "label": datasets.ClassLabel(names=["not_equivalent", "equivalent"]),
        }
    )

    def split(n: int, label: int | None) -> datasets.Dataset:
        rows = {"sentence1": [f"a {i}" for i in range(n)], "sentence2": [f"b {i}" for i in range(n)]}
        return datasets.Dataset.from_dict({**rows, "label": [i % 2 if label is None else label for i in range(n)]},
                                          features=features)

    splits = datasets.DatasetDict({"train": split(30, None), "validation": split(6, None), "test": split(5, -1)})
    splits.save_to_disk(str(root / "glue_like"))
    return root / "glue_like"


def test_hf_validation_is_the_test_split_when_test_has_no_labels(tmp_path: Path) -> None:
    folder = _glue_like(tmp_path)
    loaded = load_source(f"hf:{folder}", tmp_path, columns={"text": "sentence1", "text_pair": "sentence2"},
                         max_train_examples=10)
    assert loaded.kind == "classification" and loaded.label_names == ["not_equivalent", "equivalent"]
    assert {s: d.num_rows for s, d in loaded.splits.items()} == {"train": 10, "test": 6}
    assert loaded.splits["test"][1] == {"text": "a 1", "text_pair": "b 1", "label": 1}
    assert "test = split 'validation' (the test split has no labels)" in loaded.split_note
    assert "train subsampled to 10" in loaded.split_note


def test_hf_only_a_train_split_is_split_like_a_local_file(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    _write(folder / "train.txt", "".join(f"line {i}\n" for i in range(20)) + "\n\n")
    loaded = load_source(f"hf:{folder}", tmp_path, test_fraction=0.25, seed=3)
    local = load_source(str(folder / "train.txt"), tmp_path, test_fraction=0.25, seed=3)
    assert loaded.kind == "lm" and loaded.label_names is None
    assert loaded.splits["test"]["text"] == local.splits["test"]["text"]
    assert loaded.splits["train"]["text"] == local.splits["train"]["text"]
    assert "blank rows dropped" in loaded.split_note and "25% of split 'train', seed 3" in loaded.split_note


def test_hf_failures_are_one_line_naming_the_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    from fedlm.data.sources import hub

    def fail(error: Exception):
        def load_dataset(*args: object, **kwargs: object) -> None:
            raise error

        return load_dataset

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets, "load_dataset", fail(ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub")))
    message = _error("hf:nyu-mll/glue:sst2", tmp_path)
    assert "nyu-mll/glue" in message and "HF_HUB_OFFLINE" in message and "local" in message

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "hub_unreachable", lambda: "huggingface.co: Name or service not known")
    message = _error("hf:nyu-mll/glue:sst2", tmp_path)  # fails fast, before load_dataset's retries
    assert "cannot reach" in message and "HF_HUB_OFFLINE=1" in message and "local" in message

    monkeypatch.setattr(hub, "hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", fail(DatasetNotFoundError("Dataset 'nobody/nothing' doesn't exist")))
    assert "no dataset 'nobody/nothing'" in _error("hf:nobody/nothing", tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", fail(ValueError("BuilderConfig 'x' not found.\nAvailable: [...]")))
    assert "BuilderConfig 'x' not found" in _error("hf:nyu-mll/glue:x", tmp_path)
    assert "names no dataset" in _error("hf:", tmp_path)
    assert "no folder" in _error(f"hf:{tmp_path / 'missing'}", tmp_path)


# ---------------------------------------------------------------------------------------------- data directory


def test_missing_data_dir_says_where_it_looked_and_the_hub_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedlm.data.sources import data_dir as data_dir_module

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("FEDLM_DATA_DIR", str(empty))
    message = _error("glue/mrpc", resolve_data_dir())
    assert str(empty / "glue" / "MRPC" / "dev.tsv") in message and "FEDLM_DATA_DIR" in message
    assert "hf:nyu-mll/glue:mrpc" in message and "sentence1" in message
    assert "no equivalent on the Hugging Face hub" in _error("pubmed-abstracts", resolve_data_dir())

    monkeypatch.delenv("FEDLM_DATA_DIR")
    monkeypatch.chdir(empty)
    monkeypatch.setattr(data_dir_module, "_search_roots", lambda: iter(()))
    default = resolve_data_dir()  # no data directory anywhere: not an error until a named dataset needs it
    assert default == (tmp_path / "shared" / "data").resolve()
    message = _error("wikitext-2", default)
    assert str(default) in message and "../shared/data" in message and "does not exist" in message
    assert "--data-dir" in message and "hf:Salesforce/wikitext:wikitext-2-v1" in message
    assert load_source(str(_write(empty / "c.txt", "a\nb\n")), default).kind == "lm"


# ---------------------------------------------------------------------------------------------- issue 37


def _table(n: int = 40) -> dict[str, list]:
    """Typed columns as a Parquet file keeps them: text, an integer label, a site per row."""
    return {"review": [f"review number {i}" for i in range(n)], "stars": [i % 2 for i in range(n)],
            "site": [f"s{i % 3}" for i in range(n)]}


def _parquet(path: Path, table: dict[str, list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(table), path)
    return path


def test_parquet_is_read_directly(tmp_path: Path) -> None:
    """Issue 37 item 8: a .parquet file, data.format parquet, a folder of parquet split files and hf: on a folder
    or a single file of them all read the same rows."""
    columns = {"text": "review", "label": "stars", "group": "site"}
    path = _parquet(tmp_path / "data.parquet", _table())
    loaded = load_source(str(path), tmp_path, columns=columns, task="auto")
    assert loaded.kind == "classification" and loaded.label_names == ["0", "1"]
    assert loaded.splits["train"].column_names == ["text", "label", "group"]
    assert sum(ds.num_rows for ds in loaded.splits.values()) == 40
    renamed = path.rename(tmp_path / "data.bin")
    assert load_source(str(renamed), tmp_path, columns=columns, file_format="parquet").splits.keys() == {"train",
                                                                                                          "test"}
    folder = tmp_path / "pq"
    _parquet(folder / "train.parquet", _table(30))
    _parquet(folder / "test.parquet", _table(6))
    local = load_source(str(folder), tmp_path, columns=columns)
    hub = load_source(f"hf:{folder}", tmp_path, columns=columns)
    for split in ("train", "test"):
        assert hub.splits[split].to_dict() == local.splits[split].to_dict()
    one = load_source(f"hf:{folder / 'train.parquet'}", tmp_path, columns=columns)
    assert one.splits["train"].num_rows + one.splits["test"].num_rows == 30
    assert "parquet" in _error(str(_write(tmp_path / "data.xyz", "x\n")), tmp_path)
    broken = _write(tmp_path / "broken.parquet", "not parquet at all\n")
    message = _error(str(broken), tmp_path)
    assert message.startswith(f"cannot read {broken} as Parquet")


def test_the_group_role_keeps_a_users_column(tmp_path: Path) -> None:
    """Issue 37 item 1: data.columns.group loads the user's own column as the dataset's group column (only when
    mapped: a stray column called group changes nothing), sources with columns of their own ignore a mapping of
    the group alone (a natural partition's), and a row without a group is refused by name."""
    path = _write(tmp_path / "h.csv", "note,hospital,label\n" + "".join(
        f"note {i},{'AB'[i % 2]},{'xy'[i % 3 % 2]}\n" for i in range(20)))
    loaded = load_source(str(path), tmp_path, columns={"text": "note", "group": "hospital"})
    assert loaded.group_column == "hospital"
    assert set(loaded.splits["train"]["group"]) == {"A", "B"} and "label" in loaded.splits["train"].column_names
    by_name = _write(tmp_path / "g.csv", "text,group\n" + "".join(f"t {i},{i % 2}\n" for i in range(10)))
    assert "group" not in load_source(str(by_name), tmp_path).splits["train"].column_names
    named = load_source(str(by_name), tmp_path, columns={"group": "group"})
    assert named.group_column is None and set(named.splits["train"]["group"]) <= {"0", "1"}
    text = _write(tmp_path / "t.txt", "one\ntwo\nthree\n")
    assert load_source(str(text), tmp_path, columns={"group": "site"}).splits["train"].column_names == ["text"]
    jsonl = _write(tmp_path / "h.jsonl", "".join(json.dumps({"text": f"t {i}", "site": None if i == 3 else i})
                                                 + "\n" for i in range(10)))
    message = _error(str(jsonl), tmp_path, columns={"group": "site"})
    assert message == f"{jsonl} line 4: the group (column 'site') is missing; give every row a group name"


def test_one_class_of_labels_names_the_file_and_the_column(tmp_path: Path) -> None:
    """Issue 37 item 9: one class is refused where the labels are read, not by the model ('num_labels >= 2')."""
    path = _write(tmp_path / "one.csv", "body,verdict\n" + "".join(f"text {i},yes\n" for i in range(20)))
    columns = {"text": "body", "label": "verdict"}
    for task in ("auto", "classification"):
        message = _error(str(path), tmp_path, columns=columns, task=task)
        assert message.startswith(f"{path} (label column 'verdict') has one class ('yes') in all 20 rows")
    assert load_source(str(path), tmp_path, columns=columns, task="mlm").kind == "classification"
    folder = tmp_path / "hub"
    folder.mkdir()
    _write(folder / "train.csv", path.read_text())
    assert "(label column 'verdict') has one class" in _error(f"hf:{folder}", tmp_path, columns=columns)


def test_many_empty_texts_warn_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37 item 9: a tenth of the texts empty is one warning naming the file, the column and the count."""
    import logging

    def warnings(empty: int) -> list[str]:
        rows = "".join(f"{'' if i < empty else f'text {i}'},{'ab'[i % 2]}\n" for i in range(100))
        path = _write(tmp_path / f"e{empty}.csv", "body,label\n" + rows)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedlm"):
            load_source(str(path), tmp_path, columns={"text": "body"})
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    assert warnings(9) == []
    lines = warnings(12)
    assert len(lines) == 1 and lines[0].startswith(
        f"{tmp_path / 'e12.csv'}: 12 of 100 rows (12%) have an empty text in column 'body'")
