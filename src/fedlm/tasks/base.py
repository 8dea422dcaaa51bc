"""Task interface: how a dataset becomes batches, a loss and metrics for one model head.

A task is bound to a tokenizer (by ``preprocess`` or the constructor) because padding and masking need
its pad, mask and special token ids. Losses are means over *target units* and come with the unit count,
so federated callers can aggregate exactly (sum of mean x count / total count).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import datasets
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedlm import metrics
from fedlm.errors import UserError
from fedlm.models.device import autocast, model_device
from fedlm.models.heads import task_logits

Batch = dict[str, torch.Tensor]
Rows = datasets.Dataset | Sequence[dict]  # preprocessed examples, as a Dataset or its ``to_list()``
IGNORE_INDEX = -100  # label value that HF losses and ours skip


def chosen_metrics(task: str, offered: Sequence[str], requested: Sequence[str], headline: str) -> tuple[str, ...]:
    """``eval.metrics`` resolved against what ``task`` can report (in ``offered``'s order), the headline always
    kept (model selection reads it); an unknown name is refused in one line listing the choices."""
    unknown = [name for name in requested if name not in offered]
    if unknown:
        raise UserError(f"eval.metrics: unknown {task} metric {unknown[0]!r}; choose from {', '.join(offered)}")
    return tuple(name for name in offered if name in requested or name == headline)


class Task(ABC):
    """One training objective plus its preprocessing, batching and evaluation."""

    name: ClassVar[str]
    metric_names: ClassVar[tuple[str, ...]]  # keys that ``evaluate`` returns
    text_column: ClassVar[str] = "text"
    # Evaluate rows in order of length (less padding; about half the cost on sentence data). Only for tasks
    # whose metrics do not depend on row order and whose eval batches draw no randomness.
    sort_eval_by_length: ClassVar[bool] = False
    # ``preprocess`` makes one row per example, each from that example alone: a split tokenized once gives every
    # subset's rows (so a run tokenizes once, not once per client)
    row_wise: ClassVar[bool] = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, *, precision: str = "fp32") -> None:
        self.precision = precision  # autocast for evaluation: the run's train.precision
        self.tokenizer: PreTrainedTokenizerBase | None = None
        if tokenizer is not None:
            self.bind(tokenizer)

    def bind(self, tokenizer: PreTrainedTokenizerBase) -> Task:
        """Attach the tokenizer whose ids ``collate`` pads and masks with."""
        self.tokenizer = tokenizer
        return self

    @property
    def bound_tokenizer(self) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise RuntimeError(f"{type(self).__name__} has no tokenizer: call preprocess() or bind() first")
        return self.tokenizer

    @abstractmethod
    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """Raw text columns -> model-ready columns; binds ``tokenizer``."""

    @abstractmethod
    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """Pad ``rows`` into a batch; any randomness draws from ``generator`` only."""

    def eval_collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """``collate`` for evaluation; differs where training corrupts inputs at a configurable rate."""
        return self.collate(rows, generator)

    def loss(self, model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, int]:
        """Mean loss over the batch's target units, and the number of units (by default ``loss_from_hidden``
        on the base model's last hidden state)."""
        batch = to_device(batch, model)
        return self.loss_from_hidden(model, base_hidden(model, batch), batch)

    @abstractmethod
    def loss_from_hidden(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        """``loss`` from the base model's last hidden state (split learning computes that state in parts);
        only ``model``'s head modules are used."""

    @abstractmethod
    def target_metric(self) -> tuple[str, str]:
        """(metric name, "max" | "min") used for model selection."""

    @abstractmethod
    def _eval_batch(self, model: PreTrainedModel, batch: Batch) -> dict[str, Any]:
        """Per-batch evaluation results, combined by ``_summarize``."""

    @abstractmethod
    def _summarize(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        """Metrics over a whole dataset from its per-batch results."""

    def evaluate(
        self, model: PreTrainedModel, dataset: Rows, batch_size: int, generator: torch.Generator,
        on_batch: Callable[[int, int], None] | None = None, share: EvalShare | None = None,
    ) -> dict[str, float]:
        """Metrics over all of ``dataset`` (already preprocessed); restores the model's train/eval mode.

        An empty dataset (a client without test data) gives NaN for every metric rather than an error.
        ``on_batch(done, batches)`` is called after each batch, for a progress bar over long evaluations.
        With ``share`` several processes score the dataset together: each scores its own batches (every process
        still collates them all, so random masking draws what one process would) and all get every part.
        """
        if len(dataset) == 0:
            return dict.fromkeys(self.metric_names, math.nan)
        was_training = model.training
        model.eval()
        batches = math.ceil(len(dataset) / batch_size)
        parts: dict[int, dict[str, Any]] = {}
        try:
            with torch.no_grad(), autocast(model_device(model), self.precision):
                rows_in_order = by_length(dataset) if self.sort_eval_by_length else dataset
                for index, rows in enumerate(iter_rows(rows_in_order, batch_size)):
                    batch = self.eval_collate(rows, generator)
                    if share is None or share.owns(index):
                        parts[index] = self._eval_part(model, rows, batch)
                        if on_batch is not None:
                            on_batch(len(parts), batches)
        finally:
            model.train(was_training)
        if share is not None:
            parts = share.merge(parts)
        return self._summarize([parts[index] for index in sorted(parts)])

    def _eval_part(self, model: PreTrainedModel, rows: list[dict], batch: Batch) -> dict[str, Any]:
        """One batch's evaluation results (``_eval_batch``; a task that needs the rows too adds them)."""
        del rows
        return self._eval_batch(model, batch)


class EvalShare(Protocol):
    """One process's share of an evaluation several processes run together (``fedlm run --workers``)."""

    def owns(self, index: int) -> bool:
        """Whether this process scores batch ``index``."""

    def merge(self, parts: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Every process's parts, by batch index, handed to every process."""


class TokenPredictionTask(Task):
    """Language-modelling tasks: packed text blocks, token-level cross-entropy, perplexity."""

    metric_names = ("loss", "perplexity", "accuracy")

    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """Tokenize every text, concatenate and cut into ``max_length`` blocks (short tail dropped)."""
        self.bind(tokenizer)
        return map_batches(
            ds,
            lambda batch: {"input_ids": pack_blocks(tokenizer, batch[self.text_column], max_length)},
            batch_size=10_000,
        )

    @abstractmethod
    def _head(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Vocabulary logits (units x vocab) at the target units, and the target ids (units)."""

    def _logits_and_targets(self, model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self._head(model, base_hidden(model, batch), batch)

    def loss_from_hidden(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        logits, targets = self._head(model, hidden, batch)
        count = targets.numel()
        # sum / count rather than mean: an empty batch then yields a zero loss that still backpropagates.
        return F.cross_entropy(logits.float(), targets, reduction="sum") / max(count, 1), count

    def target_metric(self) -> tuple[str, str]:
        return ("perplexity", "min")

    def _eval_batch(self, model: PreTrainedModel, batch: Batch) -> dict[str, Any]:
        logits, targets = self._logits_and_targets(model, to_device(batch, model))
        return {
            "loss_sum": F.cross_entropy(logits.float(), targets, reduction="sum").item(),
            "count": targets.numel(),
            "correct": (logits.argmax(-1) == targets).sum().item(),
        }

    def _summarize(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        count = sum(part["count"] for part in parts)
        loss = sum(part["loss_sum"] for part in parts) / count if count else math.nan
        return {
            "loss": loss,
            "perplexity": metrics.perplexity(loss),
            "accuracy": sum(part["correct"] for part in parts) / count if count else math.nan,
        }


def map_batches(ds: datasets.Dataset, fn: Callable[[dict], dict], batch_size: int = 1000) -> datasets.Dataset:
    """Batched map replacing all columns, in memory (the data dir may be read-only) and without a
    progress bar (callers preprocess once per client)."""
    was_enabled = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return ds.map(fn, batched=True, batch_size=batch_size, remove_columns=ds.column_names, keep_in_memory=True)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def pack_blocks(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], block: int) -> list[list[int]]:
    """Concatenate the texts' ids (each ended by end-of-text where the family has one) into full blocks."""
    texts = [text for text in texts if text and text.strip()]
    if not texts:
        return []
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer(texts, verbose=False)["input_ids"]:  # long texts are cut into blocks below
        stream.extend(ids)
        if eos is not None and ids[-1:] != [eos]:
            stream.append(eos)
    return [stream[start : start + block] for start in range(0, len(stream) - block + 1, block)]


def pad_ids(sequences: Sequence[Sequence[int]], pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence; returns (ids, attention_mask)."""
    tensors = [torch.as_tensor(seq, dtype=torch.long) for seq in sequences]
    ids = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=pad_value)
    lengths = torch.tensor([len(t) for t in tensors])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return ids, mask


def pad_inputs(rows: Sequence[dict], pad_token_id: int) -> Batch:
    """The model inputs of pre-tokenized rows, right-padded: input_ids, attention_mask and, where the rows
    have them, token_type_ids (padded with 0)."""
    ids, attention_mask = pad_ids([row["input_ids"] for row in rows], pad_token_id)
    batch = {"input_ids": ids, "attention_mask": attention_mask}
    if "token_type_ids" in rows[0]:
        batch["token_type_ids"] = pad_ids([row["token_type_ids"] for row in rows], 0)[0]
    return batch


def iter_rows(dataset: Rows, batch_size: int) -> Iterator[list[dict]]:
    """Consecutive lists of row dicts, the shape ``collate`` takes, from a Dataset or a list of rows."""
    for start in range(0, len(dataset), batch_size):
        chunk = dataset[start : start + batch_size]
        if isinstance(chunk, dict):  # a Dataset slice is columnar
            chunk = [dict(zip(chunk, values, strict=True)) for values in zip(*chunk.values(), strict=True)]
        yield list(chunk)


def by_length(dataset: Rows) -> Rows:
    """``dataset`` as a list of rows, longest first (an unchanged ``dataset`` if its rows have no input_ids)."""
    rows = dataset.to_list() if isinstance(dataset, datasets.Dataset) else list(dataset)
    if not rows or "input_ids" not in rows[0]:
        return dataset
    return sorted(rows, key=lambda row: -len(row["input_ids"]))


def model_inputs(batch: Batch) -> Batch:
    """Everything but the labels: what the model (or a split client's bottom) takes."""
    return {key: value for key, value in batch.items() if key != "labels"}


def base_hidden(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The base model's last hidden state (what every task head takes)."""
    return model.base_model(**model_inputs(batch)).last_hidden_state


def next_token_logits(model: PreTrainedModel, hidden: torch.Tensor,
                      labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocabulary logits (units x vocab) at the positions that predict a labelled token (position t predicts
    label t + 1), and those labels. The head runs at those positions only: an answer of a few tokens after a
    long prompt, through Gemma's 262k-word head, would otherwise cost more than the whole model and gigabytes of
    logits per batch."""
    targets = labels[:, 1:]
    predicted = targets != IGNORE_INDEX
    return task_logits(model, hidden[:, :-1][predicted][None])[0], targets[predicted]


def to_device(batch: Batch, model: PreTrainedModel) -> Batch:
    """``batch`` on the device ``model`` computes on (collate builds batches on the CPU)."""
    device = model_device(model)
    return {key: value.to(device) for key, value in batch.items()}
