"""Check that the results index (recipes/results/README.md) agrees with the results files it links to.

    .venv/bin/python recipes/results/check_index.py        # prints each disagreement; exit status 1 if any

The index is copied from the results files by hand, so it can drift from them (issue 36 found a seed count, a
perplexity and a verdict that read differently in two places). Two things are checked mechanically, for every
table row of the index that links to a results file:
- every decimal number (0.574, +0.024, 184.25, 15.8%) and every thousands-grouped count (1,035) in the row's
  "fedlm" column appears in the linked file, with or without its sign and grouping commas;
- the link's anchor names a heading of that file (GitHub's slug: lower case, punctuation dropped, spaces to
  hyphens).
The check cannot tell that a number is quoted for the right setting, only that the file states it somewhere.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINK = re.compile(r"\]\(([\w.-]+\.md)(?:#([^)\s]*))?\)")
NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.,])\d+\.\d+")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
FEDLM_COLUMN = 3  # | claim | paper | fedlm | verdict | details |: cell 3 after splitting on "|"


@dataclass(frozen=True)
class Disagreement:
    """One index row's number or anchor that its results file does not have."""

    line: int
    target: str
    what: str

    def __str__(self) -> str:
        return f"README.md line {self.line}: {self.what} not found in {self.target}"


def slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a file, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(markdown):
        base = slug(heading)
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def _plain(text: str) -> str:
    """Text with grouping commas dropped from numbers and the typographic minus as ASCII."""
    return re.sub(r"(?<=\d),(?=\d{3})", "", text.replace("\u2212", "-"))


def disagreements(folder: Path = HERE) -> list[Disagreement]:
    """Every number or anchor of the index's rows that the linked results file lacks."""
    index = (folder / "README.md").read_text()
    files: dict[str, str] = {}
    found: list[Disagreement] = []
    for number, row in enumerate(index.splitlines(), start=1):
        cells = row.split("|")
        links = LINK.findall(row)
        if not row.startswith("|") or not links or len(cells) <= FEDLM_COLUMN + 2:
            continue
        for target, anchor in links:
            if target not in files:
                path = folder / target
                if not path.is_file():
                    found.append(Disagreement(number, target, "the file itself"))
                    continue
                files[target] = path.read_text()
            if anchor and anchor not in anchors(files[target]):
                found.append(Disagreement(number, target, f"anchor #{anchor}"))
        linked = _plain(" ".join(files.get(target, "") for target, _ in links))
        for value in NUMBER.findall(cells[FEDLM_COLUMN]):
            if _plain(value) not in linked:
                found.append(Disagreement(number, "/".join(dict.fromkeys(t for t, _ in links)), f"number {value}"))
    return found


def main() -> int:
    found = disagreements()
    for item in found:
        print(item)
    print(f"{len(found)} disagreement(s) between the index and the results files")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
