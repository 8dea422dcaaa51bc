"""Token classification (named-entity tagging) over a ``*ForTokenClassification`` head.

Words are joined by spaces and tokenized as running text, so a family tokenizes a sentence as it would
any text (byte-level BPE keeps its leading-space tokens); each sub-word is then matched to its word by
character offsets. The first sub-word of a word carries the word's tag, the others and special tokens
are ignored (-100). Evaluation maps the predictions at first sub-words back to words: a word that lost
all its sub-words to truncation is predicted ``O``, so every gold word is scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import datasets
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedlm import metrics
from fedlm.errors import UserError
from fedlm.models.heads import task_logits
from fedlm.tasks.base import IGNORE_INDEX, Batch, Task, base_hidden, map_batches, pad_ids, pad_inputs, to_device

_EVAL_ONLY = ("word_tags", "label_words")  # batch keys that evaluation adds and the model never sees


def word_spans(words: Sequence[str]) -> tuple[str, list[tuple[int, int]]]:
    """The words joined by single spaces, and each word's (start, end) character span in that text."""
    spans, position = [], 0
    for word in words:
        spans.append((position, position + len(word)))
        position += len(word) + 1
    return " ".join(words), spans


def align_labels(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], tags: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Per token: the tag of the word it starts (its first sub-word) or -100, and that word's index or -1.

    A token belongs to the word its character span overlaps; special tokens (empty spans) and tokens of
    whitespace only belong to none."""
    labels, words = [], []
    word, seen = 0, -1
    for start, end in offsets:
        while word < len(spans) and spans[word][1] <= start:
            word += 1
        inside = end > start and word < len(spans) and start < spans[word][1] and end > spans[word][0]
        if inside and word != seen:
            labels.append(int(tags[word]))
            words.append(word)
            seen = word
        else:
            labels.append(IGNORE_INDEX)
            words.append(-1)
    return labels, words


class TaggingTask(Task):
    """BIO/IOB2 tagging: token cross-entropy at first sub-words; seqeval entity P/R/F1 and word accuracy."""

    name = "tagging"
    metric_names = ("loss", "f1", "precision", "recall", "accuracy")
    row_wise = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None,
                 label_names: Sequence[str] | None = None, *, precision: str = "fp32") -> None:
        super().__init__(tokenizer, precision=precision)
        self.label_names = list(label_names) if label_names is not None else None

    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """Tokenize each sentence as running text and align its word tags to first sub-words."""
        self.bind(tokenizer)
        missing = {"tokens", "tags"} - set(ds.column_names)
        if missing:
            raise UserError(f"tagging data needs column(s) {', '.join(sorted(missing))} (a CoNLL or tokens/tags "
                            "JSONL source read with task: tagging)")

        def encode(batch: dict[str, list]) -> dict[str, list]:
            texts, spans = zip(*(word_spans(words) for words in batch["tokens"]), strict=True)
            encoded = tokenizer(list(texts), truncation=True, max_length=max_length, return_offsets_mapping=True)
            out = {key: encoded[key] for key in ("input_ids", "token_type_ids") if key in encoded}
            aligned = [align_labels(offsets, word_span, tags) for offsets, word_span, tags
                       in zip(encoded["offset_mapping"], spans, batch["tags"], strict=True)]
            out["labels"] = [labels for labels, _ in aligned]
            out["label_words"] = [words for _, words in aligned]
            out["word_tags"] = batch["tags"]
            return out

        return map_batches(ds, encode)

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        batch = pad_inputs(rows, self.bound_tokenizer.pad_token_id)
        batch["labels"] = pad_ids([row["labels"] for row in rows], IGNORE_INDEX)[0]
        return batch

    def eval_collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """``collate`` plus every gold word tag and the word each first sub-word starts (for word scoring)."""
        batch = self.collate(rows, generator)
        batch["word_tags"] = pad_ids([row["word_tags"] for row in rows], IGNORE_INDEX)[0]
        batch["label_words"] = pad_ids([row["label_words"] for row in rows], -1)[0]
        return batch

    def loss_from_hidden(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        logits = task_logits(model, hidden, batch["input_ids"])
        labels = batch["labels"]
        count = int((labels != IGNORE_INDEX).sum())
        # sum / count: a batch without labelled tokens gives a zero loss that still backpropagates
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return loss / max(count, 1), count

    def target_metric(self) -> tuple[str, str]:
        return ("f1", "max")

    def _eval_batch(self, model: PreTrainedModel, batch: Batch) -> dict[str, Any]:
        if self.label_names is None:
            raise RuntimeError("TaggingTask needs label_names (the tag set) to score entities")
        batch = to_device(batch, model)
        inputs = {key: value for key, value in batch.items() if key not in _EVAL_ONLY}
        logits = task_logits(model, base_hidden(model, inputs), batch["input_ids"]).float()
        labels = batch["labels"]
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
        predicted = logits.argmax(-1).cpu()
        gold, pred = [], []
        for row_tags, row_words, row_pred in zip(batch["word_tags"].cpu(), batch["label_words"].cpu(), predicted,
                                                 strict=True):
            tags = [self.label_names[i] for i in row_tags.tolist() if i != IGNORE_INDEX]
            guess = ["O"] * len(tags)
            for word, tag in zip(row_words.tolist(), row_pred.tolist(), strict=False):
                if word >= 0:
                    guess[word] = self.label_names[tag]
            gold.append(tags)
            pred.append(guess)
        return {"loss_sum": loss_sum, "count": int((labels != IGNORE_INDEX).sum()), "gold": gold, "pred": pred}

    def _summarize(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        count = sum(part["count"] for part in parts)
        loss = sum(part["loss_sum"] for part in parts) / count if count else math.nan
        gold = [tags for part in parts for tags in part["gold"]]
        pred = [tags for part in parts for tags in part["pred"]]
        return {"loss": loss, **metrics.entity_scores(gold, pred)}
