"""Causal (next-token) language modelling."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fedlm.tasks.base import IGNORE_INDEX, Batch, TokenPredictionTask, next_token_logits, pad_ids


class CausalLMTask(TokenPredictionTask):
    """Next-token prediction; padded positions are neither inputs that count nor targets."""

    name = "clm"

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        ids, attention_mask = pad_ids([row["input_ids"] for row in rows], self.bound_tokenizer.pad_token_id)
        labels = ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}

    def _head(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return next_token_logits(model, hidden, batch["labels"])  # padding never reaches the head
