"""A directory of ``*.txt`` documents (no train/test files): a text corpus, one example per document.

Files are found recursively (hidden files and folders skipped) and read as UTF-8; a blank document is
dropped. The test split is whole documents: each document's place in the order of
``blake2b(seed, its path relative to the directory)`` decides it, so the split depends only on the seed and
the file names (not on how the file system lists them), and a document never has text in both splits.
When the documents sit in more than one folder, ``group`` is the folder, so that ``partition.kind:
natural`` can give each client whole folders (an author, a source, a topic).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fedlm.data.sources import readers
from fedlm.data.sources.columns import Columns, RawSource, take
from fedlm.errors import UserError


def document_files(folder: Path) -> list[Path]:
    """The ``*.txt`` files under ``folder``, in the order of their relative paths; hidden ones left out."""
    found = (p for p in folder.rglob("*.txt") if p.is_file())
    visible = [p for p in found if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(visible, key=lambda p: p.relative_to(folder).as_posix())


def load_documents(folder: Path, files: list[Path], columns: dict[str, str] | None, fraction: float,
                   seed: int) -> RawSource:
    """The corpus as an unlabeled (language-model) source with a test split of whole documents."""
    if columns and set(columns) - {"text", "group"}:  # group: a natural partition's, which finds the folders
        raise UserError(f"{folder} is a directory of plain-text documents: it has no columns to map")
    names = [p.relative_to(folder).as_posix() for p in files]
    texts = [readers.read_text(p).strip() for p in files]
    kept = [i for i, text in enumerate(texts) if text]
    if len(kept) < 2:
        raise UserError(f"{folder}: {len(kept)} non-blank *.txt document(s); a train and a test split need "
                        "at least 2")
    cols: Columns = {"text": [texts[i] for i in kept]}
    folders = [str(Path(names[i]).parent) for i in kept]
    if len(set(folders)) > 1:
        cols["group"] = folders
    order = sorted(range(len(kept)), key=lambda j: _key(seed, names[kept[j]]))
    n_test = min(max(1, round(len(kept) * fraction)), len(kept) - 1)
    test, train = sorted(order[:n_test]), sorted(order[n_test:])
    blank = len(files) - len(kept)
    note = (f"{len(kept)} *.txt documents under {folder.name}/, one example each"
            + (f" ({blank} blank left out)" if blank else "")
            + (", group = folder" if "group" in cols else "")
            + f"; test = {n_test} whole documents ({fraction:.0%}), chosen by a hash of seed {seed} and each "
            "file's relative path")
    return RawSource({"train": take(cols, train), "test": take(cols, test)}, "lm", None, note, files)


def _key(seed: int, name: str) -> bytes:
    return hashlib.blake2b(f"documents:{seed}:{name}".encode(), digest_size=8).digest()
