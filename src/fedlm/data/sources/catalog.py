"""The named datasets of the shared data directory (GLUE, WikiText-2, AG News, 20newsgroups, the
biomedical corpora, CoNLL-2003 and NCBI disease NER, SQuAD v1.1 dev), each parsed from its raw files; where
the raw data has no labelled test split, one is made deterministically and ``split_note`` says how.  Where a
named dataset has an obvious equivalent on the Hugging Face hub, :data:`HUB_EQUIVALENTS` names the ``hf:``
source to use instead when online."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from fedlm.data.sources import builders, conll, readers, squad
from fedlm.data.sources.columns import (
    Columns,
    RawSource,
    check_target,
    field_of,
    num_rows,
    split_note,
    split_off_test,
    text_of,
)
from fedlm.data.sources.data_dir import describe_data_dir
from fedlm.errors import UserError

_GLUE_PAIRS = {"text": "sentence1", "text_pair": "sentence2"}
# named dataset -> (the hf: source of the same benchmark, the data.columns it needs); the rest have none.
HUB_EQUIVALENTS: dict[str, tuple[str, dict[str, str] | None]] = {
    "wikitext-2": ("hf:Salesforce/wikitext:wikitext-2-v1", None),
    "glue/sst2": ("hf:nyu-mll/glue:sst2", None),
    "glue/cola": ("hf:nyu-mll/glue:cola", None),
    "glue/mrpc": ("hf:nyu-mll/glue:mrpc", _GLUE_PAIRS),
    "glue/stsb": ("hf:nyu-mll/glue:stsb", _GLUE_PAIRS),
    "glue/qnli": ("hf:nyu-mll/glue:qnli", {"text": "question", "text_pair": "sentence"}),
    "glue/rte": ("hf:nyu-mll/glue:rte", _GLUE_PAIRS),
    "glue/wnli": ("hf:nyu-mll/glue:wnli", _GLUE_PAIRS),
    "ag_news": ("hf:fancyzhx/ag_news", None),
    "20newsgroups": ("hf:SetFit/20_newsgroups", None),
}


def hub_hint(source: str) -> str:
    """What to use instead of a named dataset whose files are missing, as the end of a sentence."""
    if source not in HUB_EQUIVALENTS:
        return " (it has no equivalent on the Hugging Face hub)"
    hub, columns = HUB_EQUIVALENTS[source]
    mapping = f" with data.columns {{{', '.join(f'{k}: {v}' for k, v in columns.items())}}}" if columns else ""
    return f", or when online use data.source: {hub}{mapping} instead"


def missing_data(source: str, data_dir: Path, missing: Path | None = None) -> UserError:
    """The one line for a named dataset whose data directory or files are missing: where fedlm looked,
    how to point it elsewhere, and the hub source to use instead."""
    what = f"{missing} not found in data directory" if missing else "no data directory at"
    return UserError(
        f"source '{source}': {what} {describe_data_dir(data_dir)}; "
        f"pass --data-dir DIR or set FEDLM_DATA_DIR{hub_hint(source)}"
    )


def _require(data_dir: Path, relative: str, source: str) -> Path:
    """A source's raw file, or the error that says where fedlm looked."""
    path = data_dir / relative
    if not path.is_file():
        raise missing_data(source, data_dir, path)
    return path


def _class_index(path: Path, where: str, value: str, names: list[str]) -> int:
    """A label given either by name or by its 0-based index."""
    value = value.strip()
    if value in names:
        return names.index(value)
    if value.isdigit() and int(value) < len(names):
        return int(value)
    raise UserError(f"{path} {where}: unknown label '{value}' (expected one of {', '.join(names)})")


def _float(path: Path, where: str, value: str) -> float:
    """A regression score, or an error naming the file and line."""
    try:
        return float(value)
    except ValueError:
        raise UserError(f"{path} {where}: score '{value}' is not a number") from None


@dataclass(frozen=True)
class _Glue:
    """Where one GLUE task's TSV files keep their text, pair and label columns."""

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
    return builders.read_table(path, "tsv", lambda tabulate: _glue_columns(path, tabulate(task.header), task))


def _glue_columns(path: Path, table: readers.Table, task: _Glue) -> Columns:
    _, records = table
    cols: Columns = {"text": [], "label": []} | ({"text_pair": []} if task.pair else {})
    for where, fields in records:
        cols["text"].append(text_of(path, where, fields, task.text))
        if task.pair:
            cols["text_pair"].append(text_of(path, where, fields, task.pair))
        raw = field_of(path, where, fields, task.label)
        label = _float(path, where, raw) if task.names is None else _class_index(path, where, raw, task.names)
        cols["label"].append(label)
    return cols


def _load_glue(name: str, data_dir: Path, fraction: float, seed: int) -> RawSource:
    task = _GLUE[name]
    folder = f"glue/{task.folder}"
    dev_path = _require(data_dir, f"{folder}/dev.tsv", name)
    dev = _read_glue(dev_path, task)
    kind = "regression" if task.names is None else "classification"
    train_path = data_dir / folder / "train.tsv"
    if name == "glue/qnli" and not train_path.is_file():
        train, test = split_off_test(dev, fraction, seed, str(dev_path))
        note = (
            f"GLUE QNLI train is not available and GLUE test has no labels: train/test are made from "
            f"dev.tsv ({num_rows(dev)} rows); {split_note(fraction, seed, 'dev')}"
        )
        return RawSource({"train": train, "test": test}, kind, task.names, note, [dev_path])
    train = _read_glue(_require(data_dir, f"{folder}/train.tsv", name), task)
    note = f"train = GLUE train.tsv; GLUE test has no labels, so dev.tsv ({num_rows(dev)} rows) is used as test"
    return RawSource({"train": train, "test": dev}, kind, task.names, note, [train_path, dev_path])


def _load_wikitext(data_dir: Path, fraction: float, seed: int) -> RawSource:
    splits: dict[str, Columns] = {}
    files = []
    for split, fname in (("train", "train.txt"), ("validation", "valid.txt"), ("test", "test.txt")):
        path = _require(data_dir, f"wikitext-2/{fname}", "wikitext-2")
        texts, groups = readers.read_wikitext(path)
        splits[split] = {"text": texts, "group": groups}
        files.append(path)
    note = (
        "train/validation/test = WikiText-2 train/valid/test.txt; one example per non-empty, "
        "non-heading line; group = article number + title"
    )
    return RawSource(splits, "lm", None, note, files)


def _load_ag_news(data_dir: Path, fraction: float, seed: int) -> RawSource:
    classes = _require(data_dir, "ag_news/classes.txt", "ag_news")
    names = builders.read_lines(classes)
    path = _require(data_dir, "ag_news/test.csv", "ag_news")
    cols = builders.read_table(path, "csv", lambda tabulate: _ag_news_columns(path, tabulate(False), names))
    train, test = split_off_test(cols, fraction, seed, str(path))
    note = (
        f"only the official AG News test.csv ({num_rows(cols)} rows) is available: train/test are made from "
        f"it; {split_note(fraction, seed, 'test.csv')}"
    )
    return RawSource({"train": train, "test": test}, "classification", names, note, [classes, path])


def _ag_news_columns(path: Path, table: readers.Table, names: list[str]) -> Columns:
    cols: Columns = {"text": [], "label": []}
    for where, fields in table[1]:
        label = field_of(path, where, fields, "0").strip()
        if not (label.isdigit() and 1 <= int(label) <= len(names)):
            raise UserError(f"{path} {where}: class index '{label}' is not in 1..{len(names)}")
        cols["text"].append(f"{text_of(path, where, fields, '1')} {text_of(path, where, fields, '2')}")
        cols["label"].append(int(label) - 1)
    return cols


def _load_20news(data_dir: Path, fraction: float, seed: int) -> RawSource:
    raw: dict[str, list[tuple[str, str]]] = {}
    files = []
    for split in ("train", "test"):
        path = _require(data_dir, f"20newsgroups/{split}.jsonl", "20newsgroups")
        raw[split] = builders.read_table(path, "jsonl", lambda tabulate, path=path: _news_rows(path, tabulate(True)))
        files.append(path)
    names = sorted({label for rows in raw.values() for _, label in rows})
    index = {n: i for i, n in enumerate(names)}
    splits = {
        s: {"text": [t for t, _ in rows], "label": [index[lab] for _, lab in rows]} for s, rows in raw.items()
    }
    note = "train/test = official 20news-bydate train/test; headers, footers and quotes kept"
    return RawSource(splits, "classification", names, note, files)


def _news_rows(path: Path, table: readers.Table) -> list[tuple[str, str]]:
    return [(text_of(path, w, f, "text"), text_of(path, w, f, "label")) for w, f in table[1]]


def _load_pubmed_abstracts(data_dir: Path, fraction: float, seed: int) -> RawSource:
    path = _require(data_dir, "pubmed-abstracts/PubMedAbstract_1MB.txt", "pubmed-abstracts")
    train, test = split_off_test({"text": builders.read_lines(path)}, fraction, seed, str(path))
    return RawSource({"train": train, "test": test}, "lm", None, split_note(fraction, seed, "the file"), [path])


_PQA_NAMES = ["yes", "no", "maybe"]


def _load_pubmedqa_rows(data_dir: Path, source: str) -> tuple[dict[str, Columns], list[Path]]:
    """PQA-L rows split by the official 500 test ids; columns text/text_pair/label."""
    main = _require(data_dir, "pubmedqa/ori_pqal.json", source)
    truth = _require(data_dir, "pubmedqa/test_ground_truth.json", source)
    data, test_ids = readers.load_json(main), readers.load_json(truth)
    if not isinstance(data, dict) or not isinstance(test_ids, dict):
        raise UserError(f"{main} / {truth}: expected JSON objects keyed by PMID")
    if missing := [pmid for pmid in test_ids if pmid not in data]:
        raise UserError(f"{truth}: test PMID {missing[0]} is not in {main}")
    splits: dict[str, Columns] = {s: {"text": [], "text_pair": [], "label": []} for s in ("train", "test")}
    for pmid, item in data.items():
        where = f"PMID {pmid}"
        contexts = field_of(main, where, item, "CONTEXTS")
        decision = field_of(main, where, item, "final_decision")
        if not isinstance(contexts, list) or decision not in _PQA_NAMES:
            raise UserError(f"{main} {where}: expected a CONTEXTS list and final_decision yes/no/maybe")
        cols = splits["test" if pmid in test_ids else "train"]
        cols["text"].append(text_of(main, where, item, "QUESTION"))
        cols["text_pair"].append(" ".join(str(c).strip() for c in contexts))
        cols["label"].append(_PQA_NAMES.index(decision))
    return splits, [main, truth]


_PQA_NOTE = "test = the 500 official PQA-L test PMIDs (test_ground_truth.json), train = the other 500"


def _load_pubmedqa(data_dir: Path, fraction: float, seed: int) -> RawSource:
    splits, files = _load_pubmedqa_rows(data_dir, "pubmedqa")
    note = f"{_PQA_NOTE}; text = QUESTION, text_pair = joined CONTEXTS, label = final_decision"
    return RawSource(splits, "classification", list(_PQA_NAMES), note, files)


def _load_pubmedqa_contexts(data_dir: Path, fraction: float, seed: int) -> RawSource:
    splits, files = _load_pubmedqa_rows(data_dir, "pubmedqa-contexts")
    lm = {s: {"text": cols["text_pair"]} for s, cols in splits.items()}
    return RawSource(lm, "lm", None, f"{_PQA_NOTE} (same split as pubmedqa); text = joined CONTEXTS", files)


def _load_ncbi(data_dir: Path, fraction: float, seed: int) -> RawSource:
    splits: dict[str, Columns] = {}
    files = []
    for split, part in (("train", "train"), ("validation", "develop"), ("test", "test")):
        path = _require(data_dir, f"ncbi-disease/NCBI{part}set_corpus.txt", "ncbi-disease-abstracts")
        splits[split] = {"text": [text for _, text in readers.read_pubtator(path)]}
        files.append(path)
    note = "train/validation/test = NCBI train/develop/test corpus files; text = title + abstract"
    return RawSource(splits, "lm", None, note, files)


def _load_biomedical(data_dir: Path, fraction: float, seed: int) -> RawSource:
    """All staged biomedical abstracts (FDAPT's domain corpus): the three sources' train splits pooled for
    pre-training, their test splits for held-out MLM loss; pubmedqa's test contexts stay out of training."""
    parts = [_load_pubmed_abstracts(data_dir, fraction, seed), _load_pubmedqa_contexts(data_dir, fraction, seed),
             _load_ncbi(data_dir, fraction, seed)]
    splits = {s: {"text": [t for p in parts for t in p.splits[s]["text"]]} for s in ("train", "test")}
    note = "train/test = the train/test splits of pubmed-abstracts + pubmedqa-contexts + ncbi-disease-abstracts: "
    note += " | ".join(p.note for p in parts)
    return RawSource(splits, "lm", None, note, [f for p in parts for f in p.files])


def _load_dialogsum(data_dir: Path, fraction: float, seed: int) -> RawSource:
    """DialogSum: text = dialogue, target = summary, group = topic. Test items carry three reference
    summaries; the first (summary1, topic1) is the target, so ROUGE here is single-reference."""
    splits: dict[str, Columns] = {}
    files = []
    for split, part in (("train", "train"), ("validation", "dev"), ("test", "test")):
        path = _require(data_dir, f"dialogsum/dialogsum.{part}.jsonl", "dialogsum")
        suffix = "1" if split == "test" else ""
        splits[split] = builders.read_table(
            path, "jsonl", lambda tabulate, path=path, suffix=suffix: _dialogsum_columns(path, tabulate(True), suffix))
        files.append(path)
    note = ("train/validation/test = DialogSum train/dev/test.jsonl; text = dialogue, target = summary "
            "(test: summary1, the first of its three references), group = topic")
    return RawSource(splits, "seq2seq", None, note, files)


def _dialogsum_columns(path: Path, table: readers.Table, suffix: str) -> Columns:
    cols: Columns = {"text": [], "target": [], "group": []}
    for where, fields in table[1]:
        cols["text"].append(text_of(path, where, fields, "dialogue"))
        cols["target"].append(check_target(path, where, text_of(path, where, fields, f"summary{suffix}")))
        cols["group"].append(text_of(path, where, fields, f"topic{suffix}"))
    return cols


def _load_conll(source: str, files: dict[str, str], about: str, data_dir: Path, fraction: float,
                seed: int) -> RawSource:
    """A named tagging corpus from its train / validation / test CoNLL files."""
    paths = {split: _require(data_dir, relative, source) for split, relative in files.items()}
    splits = {split: conll.read_conll(path) for split, path in paths.items()}
    names = "/".join(Path(relative).name for relative in files.values())
    return conll.tagging_source(splits, paths, f"train/validation/test = {names}; {about}")


_CONLL2003 = {"train": "conll2003/train.txt", "validation": "conll2003/valid.txt", "test": "conll2003/test.txt"}
_NCBI_NER = {"train": "ncbi-disease/train.tsv", "validation": "ncbi-disease/devel.tsv",
             "test": "ncbi-disease/test.tsv"}


def _load_squad(data_dir: Path, fraction: float, seed: int) -> RawSource:
    """SQuAD v1.1: only the dev set is staged, so train and test are whole articles of it."""
    path = _require(data_dir, "squad-v1.1/dev-v1.1.json", "squad")
    train, test, *articles = squad.split_by_title(squad.read_squad_json(path), fraction, seed, str(path))
    note = ("only SQuAD v1.1 dev (dev-v1.1.json) is available: train/test are made from it by article; "
            + squad.article_split_note(fraction, seed, "dev-v1.1.json", tuple(articles)))
    return RawSource({"train": train, "test": test}, "qa", None, note, [path])


_Loader = Callable[[Path, float, int], RawSource]
SOURCES: dict[str, _Loader] = {
    "wikitext-2": _load_wikitext,
    **{name: partial(_load_glue, name) for name in _GLUE},
    "ag_news": _load_ag_news,
    "20newsgroups": _load_20news,
    "pubmed-abstracts": _load_pubmed_abstracts,
    "pubmedqa": _load_pubmedqa,
    "pubmedqa-contexts": _load_pubmedqa_contexts,
    "ncbi-disease-abstracts": _load_ncbi,
    "biomedical-abstracts": _load_biomedical,
    "conll2003": partial(_load_conll, "conll2003", _CONLL2003, "CoNLL-2003 English NER, IOB2 tags (column 3)"),
    "ncbi-disease": partial(_load_conll, "ncbi-disease", _NCBI_NER, "NCBI disease NER, IOB2 tags"),
    "squad": _load_squad,
    "dialogsum": _load_dialogsum,
}


def available_sources() -> list[str]:
    """Names accepted by :func:`load_source` besides file paths."""
    return sorted(SOURCES)
