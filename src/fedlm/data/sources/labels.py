"""Labels -> the task they imply, and their encoding: class ids with sorted names, or regression scores.

With ``task: auto`` the labels decide, and a single bad value must not change the decision: one ``0.5``
among 0/1 labels would make a classification set a regression set, and a truncated ``po`` or a ``NaN``
string would become a class of its own. So a label column that is classification apart from a few stray
values is an error naming their rows; the config's ``task`` (classification or regression), when set,
always wins. The inferred task is logged in one line. Classification needs two classes at least: labels of one
class are refused by name (the file and its label column), before a model is built for them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from fedlm.data.sources.columns import Columns
from fedlm.errors import UserError

log = logging.getLogger("fedlm")

Locate = Callable[[str, int], str]  # (split, row index) -> where that row is, e.g. "data.csv line 17"

MAX_CLASSES = 20  # integer labels with at most this many values, nearly all integers: classes
FEW = 0.05  # stray values: at most this share of the rows
RARE = 100  # a class this many times rarer than the most common one is a stray value, not a class
MISSING = frozenset({"nan", "null", "n/a", "#n/a"})  # missing-value markers of spreadsheets and pandas
SHOWN = 5  # rows named in an error
MAX_NAMES = 200  # class names compared pairwise for truncation or case (the comparison is quadratic)


def encode_labels(splits: dict[str, Columns], task: str | None = None, locate: Locate | None = None,
                  labels: str = "the data's labels") -> tuple[str, list[str] | None]:
    """Classification (labels replaced by class ids; returns the names) or regression (numbers kept).

    ``task`` classification or regression forces the encoding; ``auto`` (or None) infers it and refuses a
    column with stray values; any other task (a language-model task on labelled data) infers it silently.
    ``labels`` names the label column and its file, for the error about a single class."""
    where = locate or (lambda split, i: f"{split} row {i + 1}")
    values = [v for cols in splits.values() for v in cols["label"]]
    numeric = all(isinstance(v, float) for v in values)
    if task == "regression":
        if not numeric:
            split, i = next((s, i) for s, c in splits.items() for i, v in enumerate(c["label"])
                            if not isinstance(v, float))
            raise UserError(f"task: regression needs numeric labels, but {where(split, i)} has "
                            f"{splits[split]['label'][i]!r}; fix the row or drop task: regression")
        return "regression", None
    inferring = task in (None, "auto")
    if inferring:
        _refuse_strays(splits, where, _missing(values), "a missing-value marker for a label")
    if task != "classification" and numeric and any(not v.is_integer() for v in values):
        if inferring:
            _refuse_strays(splits, where, _fractional_strays(values))
            log.info("task inferred from the labels: regression (scores %g to %g); set task: classification "
                     "to treat them as classes", min(values), max(values))
        return "regression", None
    names = _class_names(values)
    if inferring:
        _refuse_strays(splits, where, _class_strays(values))
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        # the way to regression is worth a word only where the labels could be scores
        hint = "; set task: regression to treat numeric labels as scores" if numeric else ""
        log.info("task inferred from the labels: classification, %s (%s)%s", classes(len(names)), shown, hint)
    if task in (None, "auto", "classification"):
        check_classes(names, labels, len(values))
    index = {n: i for i, n in enumerate(names)}
    for cols in splits.values():
        cols["label"] = [index[_name(v)] for v in cols["label"]]
    return "classification", names


def classes(count: int) -> str:
    """'1 class', '2 classes'."""
    return f"{count} class" if count == 1 else f"{count} classes"


def check_classes(names: list[str], labels: str, rows: int) -> None:
    """Refuse classification on fewer than two classes, naming where the labels are: a model cannot learn to
    tell one class from nothing, and the error that the model would raise names no file or column."""
    if len(names) < 2:
        got = f"one class ({names[0]!r}) in all {rows} rows" if names else "no classes"
        raise UserError(f"{labels} has {got}; classification needs at least 2 classes: map another column as "
                        "data.columns.label, or give it rows of other classes")


def _name(value: str | float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _class_names(values: list[str | float]) -> list[str]:
    """Distinct labels as class names: numbers in numeric order, else sorted as text."""
    distinct = {_name(v): v for v in values}
    numeric = all(isinstance(v, float) for v in distinct.values())
    return sorted(distinct, key=lambda n: (distinct[n], n) if numeric else (0, n))


def _fractional_strays(values: list[float]) -> set[str]:
    """The fractional values of a numeric column that is otherwise a few integer classes."""
    integers = Counter(v for v in values if v.is_integer())
    fractional = len(values) - sum(integers.values())
    if integers and len(integers) <= MAX_CLASSES and fractional <= FEW * len(values):
        return {_name(v) for v in values if not v.is_integer()}
    return set()


def _missing(values: list[str | float]) -> set[str]:
    """Missing-value markers ('NaN', 'null', 'N/A') among other labels: never a class or a score."""
    markers = {v for v in values if isinstance(v, str) and v.lower() in MISSING}
    return markers if len(markers) < len({_name(v) for v in values}) else set()


def _class_strays(values: list[str | float]) -> set[str]:
    """Class names that look like damage rather than classes: names a more common class starts with (a
    truncated 'po' beside 'pos') or differs from only in case, and classes RARE times rarer than the most
    common one; none when they would be more than a few rows."""
    counts = Counter(_name(v) for v in values)
    top = max(counts.values(), default=0)
    texts = [n for n in counts if not _is_number(n)] if len(counts) <= MAX_NAMES else []
    damaged = {
        n for n in texts for other in texts
        if n != other and counts[other] > counts[n] and (other.startswith(n) or other.lower() == n.lower())
    }
    rare = {n for n, c in counts.items() if c * RARE <= top}
    if len(counts) - len(rare) > MAX_CLASSES:  # many common values (ids, years, counts): a long tail is normal
        rare = set()
    strays = damaged | rare
    few = sum(counts[n] for n in strays) <= FEW * len(values)
    return strays if few and len(strays) < len(counts) else set()


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _refuse_strays(splits: dict[str, Columns], where: Locate, strays: set[str],
                   what: str = "a stray label among classes") -> None:
    """One line naming the first rows with stray labels, and the two ways out."""
    if not strays:
        return
    rows = [(split, i, _name(v)) for split, cols in splits.items() for i, v in enumerate(cols["label"])
            if _name(v) in strays]
    listed = "; ".join(f"{where(split, i)}: {value!r}" for split, i, value in rows[:SHOWN])
    more = f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    raise UserError(f"{len(rows)} row(s) have {what} ({listed}{more}); fix or drop those rows, or set "
                    "task: classification or task: regression to take the labels as they are")
