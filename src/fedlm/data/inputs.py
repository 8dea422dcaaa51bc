"""What a partitioner and the partition report see of a loaded split, read column by column.

A ``datasets.Dataset`` indexed by a column name gives a lazy column whose iteration decodes one row at a time
(~4 s per 100,000 rows); slicing it (``ds[name][:]``) reads the whole Arrow column at once. ``fedlm run``
and ``fedlm partition`` both build their input here, so neither walks a million rows in Python.
"""

from __future__ import annotations

import numpy as np

from fedlm.data.partition.base import PartitionInput
from fedlm.data.sources import LoadedData, conll

# columns that are model inputs or targets, never a natural partition factor
_MODEL_COLUMNS = ("text", "text_pair", "label", "target", *conll.ROLES, "answer_texts", "answer_starts")


def partition_labels(loaded: LoadedData, split: str) -> tuple[np.ndarray | None, list[str] | None]:
    """The class of each example that label-skewed partitions and the partition report use, and the class
    names: the label, or for tagging each sentence's majority entity type (``conll.sentence_entity_labels``)."""
    ds = loaded.splits[split]
    if loaded.kind == "tagging":
        return conll.sentence_entity_labels(ds["tags"][:], loaded.label_names or [])
    return (np.asarray(ds["label"][:]) if "label" in ds.column_names else None), loaded.label_names


def partition_input(loaded: LoadedData, split: str) -> PartitionInput:
    """One split's size, labels, texts and any extra (natural) columns, each read as a whole column."""
    ds = loaded.splits[split]
    labels, _ = partition_labels(loaded, split)
    extra = {name: ds[name][:] for name in ds.column_names if name not in _MODEL_COLUMNS}
    # data.columns.group: hospital -> the group column answers to 'hospital' too
    aliases = {loaded.group_column: "group"} if loaded.group_column and "group" in extra else None
    return PartitionInput(n=len(ds), labels=labels, texts=ds["text"][:], columns=extra or None,
                          fingerprint=f"{loaded.fingerprint}:{split}", aliases=aliases)
