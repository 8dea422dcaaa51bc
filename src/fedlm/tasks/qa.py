"""Extractive question answering (SQuAD) over a ``*ForQuestionAnswering`` head.

A question and its context become one or more windows of at most ``max_length`` tokens: the question
(cut to half the window if it is longer) and a slice of the context, consecutive slices sharing
``doc_stride`` tokens, so an answer cut by one window's edge lies whole in the next. Each window is one
training unit: its targets are the answer's first and last token, or position 0 when the answer is not
inside it. Evaluation takes the best span of each window (start + end logit, inside the context, at
most ``max_answer_length`` tokens), keeps the best window per question and scores its text by SQuAD
v1.1 exact match and F1 against every gold answer.
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
from fedlm.tasks.base import Batch, Task, base_hidden, map_batches, pad_ids, pad_inputs, to_device

NO_SPAN = (-1, -1)  # the offsets of a token outside the context
_EVAL_ONLY = ("context_mask",)
_MASKED = -1e9  # logit of a padding position: never a start or end, whatever the batch's padding


def cut_questions(tokenizer: PreTrainedTokenizerBase, questions: Sequence[str], limit: int) -> list[str]:
    """Questions longer than ``limit`` tokens cut after their ``limit``-th token, so a window always keeps
    room for the context."""
    encoded = tokenizer(list(questions), add_special_tokens=False, return_offsets_mapping=True)
    return [question if len(offsets) <= limit else question[: offsets[limit - 1][1]]
            for question, offsets in zip(questions, encoded["offset_mapping"], strict=True)]


def answer_tokens(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """First and last token of the answer characters [start, end) among the window's context tokens
    (``NO_SPAN`` offsets elsewhere); (0, 0) when the window does not hold the whole answer."""
    context = [i for i, span in enumerate(offsets) if tuple(span) != NO_SPAN]
    if not context or offsets[context[0]][0] > start or offsets[context[-1]][1] < end:
        return 0, 0
    first = next(i for i in context if offsets[i][1] > start)
    last = next(i for i in reversed(context) if offsets[i][0] < end)
    return first, last


def best_spans(start: torch.Tensor, end: torch.Tensor, context: torch.Tensor,
               max_answer_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per window, the span (i, j) maximising start[i] + end[j] with i <= j < i + max_answer_length and both
    in the context: (score, i, j); score -inf and i = j = -1 where the window has no context token."""
    width = min(max_answer_length, start.shape[1])
    ends = F.pad(end, (0, width - 1), value=-math.inf).unfold(1, width, 1)  # [b, i, k] = end[b, i + k]
    end_ok = F.pad(context, (0, width - 1), value=False).unfold(1, width, 1)
    scores = (start[:, :, None] + ends).masked_fill(~(context[:, :, None] & end_ok), -math.inf)
    score, flat = scores.flatten(1).max(1)
    first = torch.div(flat, width, rounding_mode="floor")
    last = first + flat % width
    none = torch.isneginf(score)
    return score, first.masked_fill(none, -1), last.masked_fill(none, -1)


class QATask(Task):
    """SQuAD-style extractive QA: start/end cross-entropy per window; exact match and F1 per question."""

    name = "qa"
    metric_names = ("loss", "exact_match", "f1")

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, doc_stride: int = 32,
                 max_answer_length: int = 30, *, precision: str = "fp32") -> None:
        if doc_stride < 0 or max_answer_length < 1:
            raise UserError(f"qa needs doc_stride >= 0 and max_answer_length >= 1, got {doc_stride}, "
                            f"{max_answer_length}")
        super().__init__(tokenizer, precision=precision)
        self.doc_stride = doc_stride
        self.max_answer_length = max_answer_length

    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """Questions + contexts -> overlapping windows with answer token targets and context offsets."""
        self.bind(tokenizer)
        missing = {"text", "text_pair", "id", "answer_texts", "answer_starts"} - set(ds.column_names)
        if missing:
            raise UserError(f"qa data needs column(s) {', '.join(sorted(missing))} (a SQuAD JSON or JSONL source "
                            "read with task: qa)")
        question_limit = max(1, max_length // 2 - 4)  # 4: the most special tokens a pair template adds
        context_room = max_length - question_limit - 4  # context tokens every window has at least
        if self.doc_stride >= context_room:
            raise UserError(f"model.doc_stride = {self.doc_stride} leaves no new context per window of "
                            f"model.max_length = {max_length}; use a doc_stride below {context_room}")

        def encode(batch: dict[str, list]) -> dict[str, list]:
            encoded = tokenizer(cut_questions(tokenizer, batch["text"], question_limit), batch["text_pair"],
                                truncation="only_second", max_length=max_length, stride=self.doc_stride,
                                return_overflowing_tokens=True, return_offsets_mapping=True)
            out: dict[str, list] = {key: [] for key in ("labels", "offsets", "example_id", "context", "answer_texts")}
            for window, example in enumerate(encoded["overflow_to_sample_mapping"]):
                sequence = encoded.sequence_ids(window)
                offsets = [list(span) if part == 1 else list(NO_SPAN)
                           for span, part in zip(encoded["offset_mapping"][window], sequence, strict=True)]
                start = batch["answer_starts"][example][0]
                end = start + len(batch["answer_texts"][example][0])
                out["labels"].append(list(answer_tokens(offsets, start, end)))
                out["offsets"].append(offsets)
                out["example_id"].append(batch["id"][example])
                out["context"].append(batch["text_pair"][example])
                out["answer_texts"].append(batch["answer_texts"][example])
            kept = {key: encoded[key] for key in ("input_ids", "token_type_ids") if key in encoded}
            return {**kept, **out}

        return map_batches(ds, encode)

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        batch = pad_inputs(rows, self.bound_tokenizer.pad_token_id)
        batch["labels"] = torch.tensor([row["labels"] for row in rows], dtype=torch.long)  # (windows, start/end)
        return batch

    def eval_collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """``collate`` plus which tokens are context (where a predicted span may lie)."""
        batch = self.collate(rows, generator)
        inside = [[span[0] != NO_SPAN[0] for span in row["offsets"]] for row in rows]
        batch["context_mask"] = pad_ids([[int(flag) for flag in flags] for flags in inside], 0)[0].bool()
        return batch

    def loss_from_hidden(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        start, end = self._start_end(model, hidden, batch)
        return self._span_loss(start, end, batch["labels"]) / max(len(start), 1), len(start)

    def target_metric(self) -> tuple[str, str]:
        return ("f1", "max")

    def _eval_part(self, model: PreTrainedModel, rows: list[dict], batch: Batch) -> dict[str, Any]:
        """Each batch's windows keep their rows: a question's answer text comes from its context, and its
        windows may fall in different batches."""
        return {**self._eval_batch(model, batch), "rows": rows}

    def _start_end(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, ...]:
        logits = task_logits(model, hidden, batch["input_ids"]).float()
        padding = batch["attention_mask"] == 0
        return tuple(part.squeeze(-1).masked_fill(padding, _MASKED) for part in logits.split(1, dim=-1))

    @staticmethod
    def _span_loss(start: torch.Tensor, end: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum over windows of the mean of the start and end cross-entropies."""
        return (F.cross_entropy(start, labels[:, 0], reduction="sum")
                + F.cross_entropy(end, labels[:, 1], reduction="sum")) / 2

    def _eval_batch(self, model: PreTrainedModel, batch: Batch) -> dict[str, Any]:
        batch = to_device(batch, model)
        inputs = {key: value for key, value in batch.items() if key not in _EVAL_ONLY}
        start, end = self._start_end(model, base_hidden(model, inputs), batch)
        score, first, last = best_spans(start, end, batch["context_mask"], self.max_answer_length)
        return {"loss_sum": self._span_loss(start, end, batch["labels"]).item(), "count": len(start),
                "score": score.cpu().tolist(), "first": first.cpu().tolist(), "last": last.cpu().tolist()}

    def _summarize(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        best: dict[str, tuple[float, str]] = {}
        gold: dict[str, list[str]] = {}
        for part in parts:
            for row, score, first, last in zip(part["rows"], part["score"], part["first"], part["last"], strict=True):
                key = row["example_id"]
                gold[key] = row["answer_texts"]
                text = row["context"][row["offsets"][first][0] : row["offsets"][last][1]] if first >= 0 else ""
                if key not in best or score > best[key][0]:
                    best[key] = (score, text)
        count = sum(part["count"] for part in parts)
        return {
            "loss": sum(part["loss_sum"] for part in parts) / count,
            "exact_match": sum(metrics.squad_exact(best[k][1], gold[k]) for k in gold) / len(gold),
            "f1": sum(metrics.squad_f1(best[k][1], gold[k]) for k in gold) / len(gold),
        }
