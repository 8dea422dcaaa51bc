"""Sequence(-pair) classification and regression over a ``*ForSequenceClassification`` head."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedlm import metrics
from fedlm.errors import UserError
from fedlm.models.heads import task_logits
from fedlm.tasks.base import Batch, Task, base_hidden, map_batches, model_inputs, pad_inputs, to_device


class SequenceTask(Task):
    """Shared plumbing: one example per row, optional text pair, one label per example."""

    pair_column: ClassVar[str] = "text_pair"
    label_column: ClassVar[str] = "label"
    label_dtype: ClassVar[torch.dtype]
    sort_eval_by_length = True  # metrics pool every example's prediction, whatever the order
    row_wise = True

    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """Tokenize text (+ pair), truncated to ``max_length``; the label column becomes ``labels``."""
        self.bind(tokenizer)
        missing = {self.text_column, self.label_column} - set(ds.column_names)
        if missing:
            raise UserError(f"{self.name} data needs column(s) {', '.join(sorted(missing))}")
        columns = [self.text_column] + ([self.pair_column] if self.pair_column in ds.column_names else [])

        def encode(batch: dict[str, list]) -> dict[str, list]:
            encoded = tokenizer(*(batch[column] for column in columns), truncation=True, max_length=max_length)
            kept = {key: encoded[key] for key in ("input_ids", "token_type_ids") if key in encoded}
            return {**kept, "labels": batch[self.label_column]}

        return map_batches(ds, encode)

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        batch = pad_inputs(rows, self.bound_tokenizer.pad_token_id)
        batch["labels"] = torch.tensor([row["labels"] for row in rows], dtype=self.label_dtype)
        return batch

    def loss(self, model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, int]:
        batch = to_device(batch, model)
        return self._loss(self._outputs(model, batch), batch["labels"]), len(batch["labels"])

    def loss_from_hidden(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        return self._loss(task_logits(model, hidden, batch["input_ids"]), batch["labels"]), len(batch["labels"])

    def _eval_batch(self, model: PreTrainedModel, batch: Batch) -> dict[str, Any]:
        batch = to_device(batch, model)
        outputs = self._outputs(model, batch)
        return {
            "loss": self._loss(outputs, batch["labels"]).item(),
            "outputs": outputs.float().cpu().numpy(),
            "labels": batch["labels"].cpu().numpy(),
        }

    def _summarize(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        labels = np.concatenate([part["labels"] for part in parts])
        outputs = np.concatenate([part["outputs"] for part in parts])
        loss = metrics.mean_loss([part["loss"] for part in parts], [len(part["labels"]) for part in parts])
        return {"loss": loss, **self._scores(outputs, labels)}

    def _outputs(self, model: PreTrainedModel, batch: Batch) -> torch.Tensor:
        config = getattr(model, "config", None)  # a baseline predictor (label prior) has none
        if getattr(config, "classifier_pooling", "first") == "mean":  # the family's forward pools otherwise
            return task_logits(model, base_hidden(model, batch), batch["input_ids"])
        return model(**model_inputs(batch)).logits

    @abstractmethod
    def _loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch's examples."""

    @abstractmethod
    def _scores(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        """Task metrics (besides loss) from the model outputs of the whole dataset."""


class ClassificationTask(SequenceTask):
    """Single-label classification: cross-entropy; accuracy, macro-F1 and MCC."""

    name = "classification"
    metric_names = ("loss", "accuracy", "macro_f1", "mcc")
    label_dtype = torch.long

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, target: str = "accuracy", *,
                 precision: str = "fp32") -> None:
        if target not in ("accuracy", "macro_f1", "mcc"):
            raise UserError(f"classification target metric must be accuracy, macro_f1 or mcc, not {target!r}")
        super().__init__(tokenizer, precision=precision)
        self.target = target

    def _loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), labels)

    def _scores(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        preds = outputs.argmax(-1)
        return {
            "accuracy": metrics.accuracy(preds, labels),
            "macro_f1": metrics.macro_f1(preds, labels),
            "mcc": metrics.mcc(preds, labels),
        }

    def target_metric(self) -> tuple[str, str]:
        return (self.target, "max")


class RegressionTask(SequenceTask):
    """Scalar regression (e.g. STS-B): MSE; Pearson and Spearman correlation."""

    name = "regression"
    metric_names = ("loss", "pearson", "spearman")
    label_dtype = torch.float32

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, target: str = "pearson", *,
                 precision: str = "fp32") -> None:
        if target not in ("pearson", "spearman"):
            raise UserError(f"regression target metric must be pearson or spearman, not {target!r}")
        super().__init__(tokenizer, precision=precision)
        self.target = target

    def _loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs.float().squeeze(-1), labels)

    def _scores(self, outputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        preds = outputs.squeeze(-1)
        return {"pearson": metrics.pearson(preds, labels), "spearman": metrics.spearman(preds, labels)}

    def target_metric(self) -> tuple[str, str]:
        return (self.target, "max")
