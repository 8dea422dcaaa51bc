"""Sequence-to-sequence (source text -> target text): summarisation, translation, any text rewriting.

Two model kinds train on the same rows and report the same metrics:

* encoder-decoder (t5, bart; ``*ForConditionalGeneration``): the encoder reads the source, the decoder is
  teacher-forced on the target (the family's own label shift, e.g. T5 starts from pad, BART from ``</s>``);
* decoder-only (gpt2, llama) as a prompted causal LM: ``source </s> target </s>`` in one sequence, the loss
  on the target tokens and the final end-of-text only, so the model learns to continue a source with its
  target and never to reproduce sources. Its head is the plain LM head, so split learning runs it as it
  runs causal LM (the labels stay with the client's top).

The loss is the mean token cross-entropy over target tokens (units = target tokens, like causal LM), and
evaluation decodes every example (greedy or beam search, batched, ``max_new_tokens`` at most) and scores
ROUGE-1/2/L F-measure with stemming (ROUGE-L is the headline); ``eval.metrics`` adds SQuAD's exact match and
token F1 of each decoded text against its reference (short answers: a label, a number, an entity) and the
perplexity of the references, or leaves ROUGE-1/2 out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import datasets
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedlm import metrics
from fedlm.errors import UserError
from fedlm.tasks.base import (
    IGNORE_INDEX,
    Batch,
    Task,
    base_hidden,
    chosen_metrics,
    map_batches,
    next_token_logits,
    pad_ids,
    to_device,
)
from fedlm.tasks.generation import Decoding, bytes_to_texts, generate, left_pad, texts_to_bytes

_TRAIN_KEYS = ("input_ids", "attention_mask", "labels")  # what training batches hold (and split clients send)


class Seq2SeqTask(Task):
    """Source -> target text for an encoder-decoder or a decoder-only (prompted) language model."""

    name = "seq2seq"
    metric_names = ("loss", "rouge1", "rouge2", "rougeL")  # the default; eval.metrics chooses from OFFERED
    OFFERED: ClassVar[tuple[str, ...]] = ("loss", "perplexity", "rouge1", "rouge2", "rougeL", "exact_match", "f1")
    target_column: ClassVar[str] = "target"
    row_wise = True

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None = None,
        encoder_decoder: bool = False,
        num_beams: int = 1,
        max_new_tokens: int = 64,
        *,
        metrics: Sequence[str] | None = None,
        precision: str = "fp32",
    ) -> None:
        super().__init__(tokenizer, precision=precision)
        if metrics is not None:
            self.metric_names = chosen_metrics(self.name, self.OFFERED, metrics, self.target_metric()[0])
        self.encoder_decoder = encoder_decoder
        self.decoding = Decoding(num_beams=num_beams, max_new_tokens=max_new_tokens)
        self.stop_ids: tuple[int, ...] = ()  # tokens besides eos that end a generated answer (chat: end of turn)

    # ------------------------------------------------------------------------------------------- rows

    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """Source (``text``) and ``target`` columns -> token ids; the target is cut to ``max_new_tokens``
        (decoding could not produce more), the source to what ``max_length`` leaves; the full target text is
        kept as the ROUGE reference."""
        self.bind(tokenizer)
        missing = {self.text_column, self.target_column} - set(ds.column_names)
        if missing:
            raise UserError(f"seq2seq data needs column(s) {', '.join(sorted(missing))}: map them with "
                            "data.columns {text: <source column>, target: <target column>}")
        empty = next((i for i, text in enumerate(ds[self.target_column]) if not text.strip()), None)
        if empty is not None:
            raise UserError(f"seq2seq example {empty} has an empty target; every example needs target text")
        encode = self._encoder_decoder_rows(max_length) if self.encoder_decoder else self._prompted_rows(max_length)
        return map_batches(ds, encode)

    def _encoder_decoder_rows(self, max_length: int) -> Callable[[dict[str, list]], dict[str, list]]:
        """Encoder of (source ids, target ids) rows, each with the family's special tokens."""
        tokenizer = self.bound_tokenizer

        def encode(batch: dict[str, list]) -> dict[str, list]:
            sources = tokenizer(batch[self.text_column], truncation=True, max_length=max_length)["input_ids"]
            targets = tokenizer(batch[self.target_column], truncation=True,
                                max_length=self.decoding.max_new_tokens)["input_ids"]
            return {"input_ids": sources, "labels": targets, "reference": batch[self.target_column]}

        return encode

    def _prompted_rows(self, max_length: int) -> Callable[[dict[str, list]], dict[str, list]]:
        """Encoder of ``source </s> target </s>`` rows; the source keeps ``max_length - max_new_tokens - 1``
        tokens, so a prompt plus the longest generation always fits in ``max_length``."""
        tokenizer = self.bound_tokenizer
        eos, budget = tokenizer.eos_token_id, self.decoding.max_new_tokens
        if eos is None:
            raise UserError("seq2seq with a decoder-only model needs an end-of-text token; this tokenizer has none")
        source_budget = max_length - budget - 1
        if source_budget < 1:
            raise UserError(f"model.max_length = {max_length} leaves no room for a source: a decoder-only seq2seq "
                            f"sequence holds source + separator + generation.max_new_tokens ({budget}); raise "
                            "model.max_length or lower generation.max_new_tokens")

        def encode(batch: dict[str, list]) -> dict[str, list]:
            sources = tokenizer(batch[self.text_column], truncation=True, max_length=source_budget)["input_ids"]
            targets = tokenizer(batch[self.target_column], add_special_tokens=False, truncation=True,
                                max_length=budget - 1)["input_ids"]
            prompts = [ids if ids[-1:] == [eos] else [*ids, eos] for ids in sources]
            return {
                "input_ids": [[*prompt, *target, eos] for prompt, target in zip(prompts, targets, strict=True)],
                "prompt_length": [len(prompt) for prompt in prompts],
                "reference": batch[self.target_column],
            }

        return encode

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """input_ids, attention_mask and labels (IGNORE_INDEX where no target token is)."""
        ids, mask = pad_ids([row["input_ids"] for row in rows], self.bound_tokenizer.pad_token_id)
        if self.encoder_decoder:
            labels = pad_ids([row["labels"] for row in rows], IGNORE_INDEX)[0]
        else:  # the prompt and the padding are inputs, not targets
            prompt = torch.arange(ids.shape[1])[None, :] < torch.tensor([row["prompt_length"] for row in rows])[:, None]
            labels = ids.masked_fill(prompt | (mask == 0), IGNORE_INDEX)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def eval_collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """``collate`` plus the references and, for a decoder-only model, its left-padded prompts."""
        batch = self.collate(rows, generator)
        batch["references"] = texts_to_bytes([row["reference"] for row in rows])
        if not self.encoder_decoder:
            prompts = [row["input_ids"][: row["prompt_length"]] for row in rows]
            batch["prompt_ids"], batch["prompt_mask"] = left_pad(prompts, self.bound_tokenizer.pad_token_id)
        return batch

    # ------------------------------------------------------------------------------------------- loss

    def loss(self, model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, int]:
        return _token_loss(*self._logits_and_targets(model, to_device(batch, model)))

    def loss_from_hidden(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        if self.encoder_decoder:
            raise UserError(f"split learning does not cut encoder-decoder models ({model.config.model_type}); "
                            "use a decoder-only family (gpt2, llama) for split seq2seq")
        return _token_loss(*next_token_logits(model, hidden, batch["labels"]))

    def _logits_and_targets(self, model: PreTrainedModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {key: batch[key] for key in _TRAIN_KEYS}
        if not self.encoder_decoder:
            return next_token_logits(model, base_hidden(model, inputs), inputs["labels"])
        labels = inputs["labels"]
        logits = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels=labels),
        ).logits
        predicted = labels != IGNORE_INDEX
        return logits[predicted], labels[predicted]

    def target_metric(self) -> tuple[str, str]:
        return ("rougeL", "max")

    # ------------------------------------------------------------------------------------- evaluation

    def _eval_batch(self, model: PreTrainedModel, batch: Batch) -> dict[str, Any]:
        batch = to_device(batch, model)
        logits, targets = self._logits_and_targets(model, batch)
        prompt = ("input_ids", "attention_mask") if self.encoder_decoder else ("prompt_ids", "prompt_mask")
        predictions = generate(model, self.bound_tokenizer, batch[prompt[0]], batch[prompt[1]], self.decoding,
                               self.stop_ids)
        return {
            "loss_sum": F.cross_entropy(logits.float(), targets, reduction="sum").item(),
            "count": targets.numel(),
            "predictions": predictions,
            "references": bytes_to_texts(batch["references"]),
        }

    def _summarize(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        count = sum(part["count"] for part in parts)
        predictions = [text for part in parts for text in part["predictions"]]
        references = [text for part in parts for text in part["references"]]
        loss = sum(part["loss_sum"] for part in parts) / count if count else math.nan
        scores = {"loss": loss, "perplexity": metrics.perplexity(loss) if count else math.nan,
                  **metrics.rouge(predictions, references)}  # ROUGE-L, the headline, is always reported
        if "exact_match" in self.metric_names or "f1" in self.metric_names:
            scores["exact_match"] = _mean([metrics.squad_exact(p, [r]) for p, r in zip(predictions, references,
                                                                                         strict=True)])
            scores["f1"] = _mean([metrics.squad_f1(p, [r]) for p, r in zip(predictions, references, strict=True)])
        return {name: scores[name] for name in self.metric_names}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    count = targets.numel()
    # sum / count rather than mean: an empty batch then yields a zero loss that still backpropagates
    return F.cross_entropy(logits.float(), targets, reduction="sum") / max(count, 1), count
