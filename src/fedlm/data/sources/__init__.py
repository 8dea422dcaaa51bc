"""Named datasets from the shared data directory, ``hf:<dataset>[:<config>]`` sources and local files, as Hugging
Face datasets.

CSV / TSV / JSON Lines / JSON / text files are read through ``datasets``' builders (``builders.py``), with a
hand reader behind each for what the builder cannot say (the line of an error); Parquet through pyarrow, and
formats no builder reads have hand readers only (``readers.py``).  ``hf:`` sources go through
``datasets.load_dataset`` (``hub.py``). The result is built with ``Dataset.from_dict`` (in memory); local files
leave nothing in the HF cache and work from a read-only data directory.  Splits that the raw data does not
provide are made deterministically by hashing ``(seed, row index)``, which is stable across numpy/datasets
versions and platforms; ``split_note`` records every such choice.

Returned columns: ``text``, optional ``text_pair``, ``label`` (``ClassLabel`` ints for classification, float32
for regression, absent for LM corpora) and ``group``, each row's silo for natural partitions: wikitext-2's
article (number + title), dialogsum's topic, a document's folder, or the user's column that ``data.columns``
maps as ``group`` (``LoadedData.group_column`` keeps its own name).  Tagging data (``conll.py``) has ``tokens``
and ``tags`` instead of a label, QA data (``squad.py``) the question as ``text``, the context as ``text_pair``,
``id``, ``title``, ``answer_texts`` and ``answer_starts``; local files are read as either when ``load_source``
is given that ``task``."""

from fedlm.data.sources.catalog import available_sources
from fedlm.data.sources.data_dir import resolve_data_dir
from fedlm.data.sources.loader import LoadedData, load_source

__all__ = ["LoadedData", "available_sources", "load_source", "resolve_data_dir"]
