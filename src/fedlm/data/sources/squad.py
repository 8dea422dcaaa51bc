"""Extractive question answering data: SQuAD JSON and JSON Lines.

A QA split is the columns ``text`` (the question), ``text_pair`` (the context), ``id``, ``title`` (the
article, or the context when there is none: what splits and partitions keep together),
``answer_texts`` and ``answer_starts`` (every gold answer and its 0-based character offset in the
context; training uses the first, scoring all).  Every answer must be found in its context at its offset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

from fedlm.data.sources import readers
from fedlm.data.sources.columns import Columns, RawSource, hash_order, split_files, take
from fedlm.errors import UserError

QA_SUFFIXES = (".json", ".jsonl")
QA_COLUMNS = ("text", "text_pair", "id", "title", "answer_texts", "answer_starts")
def _empty() -> Columns:
    return {column: [] for column in QA_COLUMNS}


def _answers(path: Path, where: str, raw: Any) -> tuple[list[str], list[int]]:
    """``[{text, answer_start}, ...]`` (SQuAD) or ``{text: [...], answer_start: [...]}`` (Hugging Face)."""
    if isinstance(raw, dict) and isinstance(raw.get("text"), list):
        pairs = list(zip(raw["text"], raw.get("answer_start") or [], strict=False))
        if len(pairs) != len(raw["text"]) or len(pairs) != len(raw.get("answer_start") or []):
            raise UserError(f"{path} {where}: answers.text and answers.answer_start differ in length")
    elif isinstance(raw, list) and all(isinstance(a, dict) for a in raw):
        pairs = [(a.get("text"), a.get("answer_start")) for a in raw]
    else:
        raise UserError(f"{path} {where}: answers should be a list of {{text, answer_start}} objects")
    if not pairs:
        raise UserError(f"{path} {where}: no answers (extractive QA needs at least one answer per question)")
    for text, start in pairs:
        if not isinstance(text, str) or not isinstance(start, int) or isinstance(start, bool):
            raise UserError(f"{path} {where}: each answer needs a text string and an integer answer_start")
    return [text for text, _ in pairs], [start for _, start in pairs]


def _add(cols: Columns, path: Path, where: str, item: dict, context: Any, title: str) -> None:
    """One question, its answers checked against the context."""
    question, qid = item.get("question"), item.get("id", where)
    if not isinstance(question, str) or not question.strip():
        raise UserError(f"{path} {where}: no question text")
    if not isinstance(context, str) or not context.strip():
        raise UserError(f"{path} {where}: no context text")
    texts, starts = _answers(path, f"{where} (question {qid})", item.get("answers"))
    for text, start in zip(texts, starts, strict=True):
        found = context[start : start + len(text)] if start >= 0 else ""
        if found != text or not text.strip():
            raise UserError(f"{path} {where} (question {qid}): answer {text!r} does not match the context at "
                            f"character {start} (found {found!r}); answer_start must be the 0-based character "
                            "offset of the answer in the context")
    for column, value in zip(QA_COLUMNS, (question, context, str(qid), title, texts, starts), strict=True):
        cols[column].append(value)


def read_squad_json(path: Path) -> Columns:
    """The official SQuAD layout: ``{data: [{title, paragraphs: [{context, qas: [{id, question, answers}]}]}]}``."""
    doc = readers.load_json(path)
    articles = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(articles, list):
        raise UserError(f"{path}: expected SQuAD JSON, an object with a 'data' list of articles")
    cols = _empty()
    for a, article in enumerate(articles):
        title = str(article.get("title", f"article {a}")) if isinstance(article, dict) else ""
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise UserError(f"{path} article {a}: no 'paragraphs' list")
        for p, paragraph in enumerate(paragraphs):
            for q, item in enumerate(paragraph.get("qas", []) if isinstance(paragraph, dict) else []):
                if not isinstance(item, dict):
                    raise UserError(f"{path} article {a} paragraph {p} question {q}: not an object")
                _add(cols, path, f"article {a} paragraph {p}", item, paragraph.get("context"), title)
    if not cols["text"]:
        raise UserError(f"no questions in {path}")
    return cols


def read_qa_jsonl(path: Path) -> Columns:
    """One question per line: ``question``, ``context``, ``answers`` (SQuAD or Hugging Face form), and
    optional ``id`` and ``title``."""
    cols = _empty()
    for where, fields in readers.read_jsonl(path)[1]:
        context = fields.get("context")
        _add(cols, path, where, fields, context, str(fields.get("title", context)))
    if not cols["text"]:
        raise UserError(f"no questions in {path}")
    return cols


def read_qa(path: Path, file_format: str | None) -> Columns:
    fmt = (file_format or path.suffix.lower().lstrip(".")).lower()
    if fmt not in ("json", "jsonl"):
        raise UserError(f"{path}: QA data is SQuAD JSON (.json) or JSON Lines (.jsonl); set data.format")
    return read_qa_jsonl(path) if fmt == "jsonl" else read_squad_json(path)


def split_by_title(cols: Columns, fraction: float, seed: int, what: str) -> tuple[Columns, Columns, int, int]:
    """Deterministic (train, test) split of whole articles (by ``title``): no context is in both; also
    returns the article counts (train, test)."""
    titles = list(dict.fromkeys(cols["title"]))
    if len(titles) < 2:
        raise UserError(f"{what} has {len(titles)} article(s): too few to split off a test set by article")
    n_test = min(max(1, round(len(titles) * fraction)), len(titles) - 1)
    test_titles = {titles[i] for i in hash_order(len(titles), seed, "test-split-articles")[:n_test]}
    test = [i for i, title in enumerate(cols["title"]) if title in test_titles]
    train = [i for i, title in enumerate(cols["title"]) if title not in test_titles]
    return take(cols, train), take(cols, test), len(titles) - n_test, n_test


def article_split_note(fraction: float, seed: int, of: str, articles: tuple[int, int]) -> str:
    return (f"test = {fraction:.0%} of the articles of {of} ({articles[1]} test, {articles[0]} train articles), "
            f"seed {seed}, deterministic (hash of seed and article index); no article is in both")


def load_qa(path: Path, columns: dict[str, str] | None, file_format: str | None, fraction: float,
            seed: int) -> RawSource:
    """A local SQuAD JSON / JSONL file, or a directory of train / dev / test files."""
    if columns:
        raise UserError("QA data uses the SQuAD field names (question, context, answers, id, title); "
                        "remove data.columns")
    files = (split_files(path, QA_SUFFIXES, "expected train.json/.jsonl for task qa")
             if path.is_dir() else {"train": path})
    splits = {split: read_qa(p, file_format) for split, p in files.items()}
    if "test" in splits:
        note = f"train/test = the given files ({', '.join(p.name for p in files.values())})"
    else:
        splits["train"], splits["test"], *articles = split_by_title(splits["train"], fraction, seed,
                                                                   str(files["train"]))
        note = article_split_note(fraction, seed, files["train"].name, tuple(articles))
    return RawSource(splits, "qa", None, note, list(files.values()))


def features(cols: Columns) -> dict[str, Any]:
    """The dataset features of the QA columns present in ``cols``."""
    if "answer_texts" not in cols:
        return {}
    return {"id": datasets.Value("string"), "title": datasets.Value("string"),
            "answer_texts": datasets.Sequence(datasets.Value("string")),
            "answer_starts": datasets.Sequence(datasets.Value("int32"))}
