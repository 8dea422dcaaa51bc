"""Multiple-choice scoring by log-likelihood, as lm-evaluation-harness scores LLMs (PubMedQA, MMLU, ...).

An item is a prompt, its options and the index of the right one. Each option is scored by the summed
log-probability of its tokens given the prompt (the continuation is ``" " + option``: lm-eval's target
delimiter, so ``Answer:`` is followed by `` yes``); the prediction is the best option (``acc``) or the best
after dividing by the option's length in *characters*, the delimiter not counted (``acc_norm``, lm-eval's
``acc_norm``: it does not favour options that split into fewer tokens). ``loss`` / ``perplexity`` are the mean
token cross-entropy of the right option, which is also what training minimises: a causal LM on
``prompt + " " + right option``, the loss on the option's tokens only. Decoder-only models only.

Rows come from a classification source (options = its label names: ``pubmedqa`` gives yes / no / maybe, its
question and abstract laid out as lm-eval's PubMedQA prompt) or carry their own ``options`` list per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedlm.errors import UserError
from fedlm.metrics import perplexity
from fedlm.models.heads import task_logits
from fedlm.models.presets import is_decoder_family
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

DELIMITER = " "  # between prompt and option, as lm-eval's target_delimiter
# lm-eval's PubMedQA prompt ("Abstract: ...\nQuestion: ...\nAnswer:") with a label that fits any passage
PAIR_PROMPT = "Context: {pair}\nQuestion: {text}\nAnswer:"
CHOICE_METRICS = ("acc", "acc_norm", "loss", "perplexity")


def choice_loglikelihoods(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int],
    option_ids_list: Sequence[Sequence[int]],
) -> tuple[list[float], list[int]]:
    """Summed log-probability of each option's tokens after ``prompt_ids``, and its token count (the options
    of one item in one padded forward pass)."""
    scores = sequence_loglikelihoods(model, tokenizer.pad_token_id, [(prompt_ids, ids) for ids in option_ids_list])
    return scores, [len(ids) for ids in option_ids_list]


def sequence_loglikelihoods(
    model: PreTrainedModel, pad_token_id: int | None, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> list[float]:
    """log P(continuation | context) for each (context ids, continuation ids), in one right-padded batch;
    the vocabulary head runs at the continuation positions only (a 256k vocabulary over whole prompts would
    not fit)."""
    check_decoder(model)
    if any(not context or not continuation for context, continuation in pairs):
        raise ValueError("every context and continuation needs at least one token")
    # position t predicts token t + 1: the continuation's tokens are predicted from len(context) - 1 on
    rows, positions, targets = [], [], []
    for index, (context, continuation) in enumerate(pairs):
        start = len(context) - 1
        rows += [index] * len(continuation)
        positions += range(start, start + len(continuation))
        targets += continuation
    sequences = [[*context, *continuation] for context, continuation in pairs]
    logprobs = _logprobs_at(model, pad_token_id, sequences, rows, positions)
    device = logprobs.device
    token_scores = logprobs.gather(1, torch.tensor(targets, device=device)[:, None])[:, 0]
    sums = torch.zeros(len(pairs), dtype=torch.float64, device=device)
    sums.index_add_(0, torch.tensor(rows, device=device), token_scores.double())
    return sums.tolist()


def next_token_logprobs(model: PreTrainedModel, pad_token_id: int | None,
                        contexts: Sequence[Sequence[int]]) -> torch.Tensor:
    """log P(next token | context) over the vocabulary (contexts x vocab, float32) for each context, in one
    right-padded batch: what every one-token continuation of a context is scored from."""
    check_decoder(model)
    if any(not context for context in contexts):
        raise ValueError("every context needs at least one token")
    return _logprobs_at(model, pad_token_id, [list(context) for context in contexts], list(range(len(contexts))),
                        [len(context) - 1 for context in contexts])


def _logprobs_at(model: PreTrainedModel, pad_token_id: int | None, sequences: list[list[int]], rows: list[int],
                 positions: list[int]) -> torch.Tensor:
    """Next-token log-probabilities (float32) at each (row, position) of ``sequences`` right-padded into one
    batch; the vocabulary head runs at those positions only."""
    ids, mask = pad_ids(sequences, pad_token_id if pad_token_id is not None else 0)
    hidden = base_hidden(model, to_device({"input_ids": ids, "attention_mask": mask}, model))
    device = hidden.device
    picked = hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]
    return F.log_softmax(task_logits(model, picked[None])[0].float(), dim=-1)


def check_decoder(model: PreTrainedModel) -> None:
    """Log-likelihood scoring reads next-token probabilities: a masked LM or encoder-decoder has none."""
    family = model.config.model_type
    if not is_decoder_family(family):
        raise UserError(f"multiple-choice scoring needs a decoder-only (causal LM) model, not a {family!r} model")


def choice_scores(loglikelihoods: Sequence[Sequence[float]], option_chars: Sequence[Sequence[int]],
                  labels: Sequence[int]) -> dict[str, float]:
    """acc (argmax of the summed log-likelihoods) and acc_norm (argmax of log-likelihood / option characters,
    as lm-eval) over items; ties go to the first option, as numpy's argmax."""
    if not labels:
        return {"acc": math.nan, "acc_norm": math.nan}
    acc = [int(np.argmax(ll)) == gold for ll, gold in zip(loglikelihoods, labels, strict=True)]
    norm = [int(np.argmax(np.asarray(ll) / np.asarray(chars, dtype=np.float64))) == gold
            for ll, chars, gold in zip(loglikelihoods, option_chars, labels, strict=True)]
    return {"acc": float(np.mean(acc)), "acc_norm": float(np.mean(norm))}


class MultipleChoiceTask(Task):
    """Prompt + options + answer index: trained as a causal LM on the right option, scored by log-likelihood."""

    name = "multiple_choice"
    metric_names = CHOICE_METRICS
    row_wise = True

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None = None,
        options: Sequence[str] | None = None,
        metrics: Sequence[str] | None = None,
        *,
        precision: str = "fp32",
    ) -> None:
        super().__init__(tokenizer, precision=precision)
        self.options = list(options) if options else None  # every item's options, unless a row has its own
        if metrics is not None:
            self.metric_names = chosen_metrics(self.name, CHOICE_METRICS, metrics, self.target_metric()[0])

    # ------------------------------------------------------------------------------------------- rows

    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """``text`` (the prompt, or with ``text_pair`` the question of :data:`PAIR_PROMPT`), ``label`` (the right
        option's index) and the options -> the training sequence (prompt + right option), its prompt length and
        every option's continuation ids and character count. A long prompt loses its start (the question and
        ``Answer:`` are at its end), as lm-eval truncates."""
        self.bind(tokenizer)
        missing = {self.text_column, "label"} - set(ds.column_names)
        if missing:
            raise UserError(f"multiple_choice data needs column(s) {', '.join(sorted(missing))}: the prompt (text) "
                            "and the right option's index (label)")
        per_row = "options" in ds.column_names
        offset = [0]  # rows seen in earlier batches, for errors that name the row

        def encode(batch: dict[str, list]) -> dict[str, list]:
            prompts = batch[self.text_column]
            if "text_pair" in batch:  # a question (text) about a passage (text_pair), e.g. pubmedqa
                prompts = [PAIR_PROMPT.format(text=text, pair=pair)
                           for text, pair in zip(prompts, batch["text_pair"], strict=True)]
            options = batch["options"] if per_row else [self.options] * len(prompts)
            for index, (choices, label) in enumerate(zip(options, batch["label"], strict=True)):
                self._check_item(offset[0] + index, choices, label)
            offset[0] += len(prompts)
            encoded = [self._encode_item(prompt, choices, int(label), max_length)
                       for prompt, choices, label in zip(prompts, options, batch["label"], strict=True)]
            return {key: [item[key] for item in encoded] for key in encoded[0]} if encoded else {}

        return map_batches(ds, encode)

    def _check_item(self, row: int, options: Sequence[str] | None, label: Any) -> None:
        if not options or len(options) < 2 or any(not str(option).strip() for option in options):
            raise UserError(f"multiple_choice row {row}: needs two or more non-empty options (an options column, "
                            "or a classification source whose label names are the options)")
        if not isinstance(label, int | float) or not float(label).is_integer() or not 0 <= int(label) < len(options):
            raise UserError(f"multiple_choice row {row}: answer {label!r} is not among its {len(options)} options "
                            "(label is the right option's 0-based index)")

    def _encode_item(self, prompt: str, options: Sequence[str], label: int, max_length: int) -> dict[str, Any]:
        tokenizer = self.bound_tokenizer
        context = tokenizer(prompt)["input_ids"]
        continuations = [self._continuation(prompt, context, str(option)) for option in options]
        budget = max_length - max(len(ids) for ids in continuations)
        if budget < 1:
            raise UserError(f"model.max_length = {max_length} leaves no room for a prompt before the longest "
                            "option: raise model.max_length")
        if len(context) > budget:  # keep the end (the question), and a leading BOS the model expects
            bos = tokenizer.bos_token_id
            keep_bos = bos is not None and context[0] == bos
            context = [bos, *context[len(context) - budget + 1:]] if keep_bos else context[len(context) - budget:]
        return {
            "input_ids": [*context, *continuations[label]],
            "prompt_length": len(context),
            "option_ids": continuations,
            "option_chars": [len(str(option)) for option in options],
            "label": label,
        }

    def _continuation(self, prompt: str, context: list[int], option: str) -> list[int]:
        """The option's token ids as they follow the prompt: the ids of prompt + delimiter + option past the
        prompt's (lm-eval's split), or the option alone where the tokenizer merges across the boundary."""
        tokenizer = self.bound_tokenizer
        whole = tokenizer(prompt + DELIMITER + option)["input_ids"]
        eos = tokenizer.eos_token_id
        if eos is not None and whole[-1:] == [eos] and context[-1:] == [eos]:  # a tokenizer that appends EOS
            whole, context = whole[:-1], context[:-1]
        if whole[: len(context)] == context and len(whole) > len(context):
            return whole[len(context):]
        return tokenizer(DELIMITER + option, add_special_tokens=False)["input_ids"]

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """input_ids, attention_mask and labels: the right option's tokens; prompt and padding are ignored."""
        ids, mask = pad_ids([row["input_ids"] for row in rows], self.bound_tokenizer.pad_token_id)
        prompt = torch.arange(ids.shape[1])[None, :] < torch.tensor([row["prompt_length"] for row in rows])[:, None]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(prompt | (mask == 0), IGNORE_INDEX)}

    # ------------------------------------------------------------------------------------------- loss

    def loss_from_hidden(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int]:
        logits, targets = next_token_logits(model, hidden, batch["labels"])  # the right option's tokens only
        count = targets.numel()
        # sum / count rather than mean: an empty batch then yields a zero loss that still backpropagates
        return F.cross_entropy(logits.float(), targets, reduction="sum") / max(count, 1), count

    def target_metric(self) -> tuple[str, str]:
        return ("acc", "max")

    # ------------------------------------------------------------------------------------- evaluation

    def _eval_batch(self, model: PreTrainedModel, batch: Batch) -> dict[str, Any]:
        raise NotImplementedError("multiple_choice scores rows (their options), not a collated batch")

    def _eval_part(self, model: PreTrainedModel, rows: list[dict], batch: Batch) -> dict[str, Any]:
        """Every option of every row: rows whose options are one token each (PubMedQA's yes / no / maybe) from one
        pass over their prompts, the next-token distribution scoring all options at once; the others in one pass
        over every prompt + option."""
        del batch
        pad = self.bound_tokenizer.pad_token_id
        scores: list[list[float]] = [[] for _ in rows]
        short: list[int] = []
        long: list[int] = []
        for i, row in enumerate(rows):
            (short if all(len(ids) == 1 for ids in row["option_ids"]) else long).append(i)
        if short:
            prompts = [rows[i]["input_ids"][: rows[i]["prompt_length"]] for i in short]
            for i, logprobs in zip(short, next_token_logprobs(model, pad, prompts), strict=True):
                scores[i] = logprobs[[ids[0] for ids in rows[i]["option_ids"]]].double().tolist()
        pairs = [(rows[i]["input_ids"][: rows[i]["prompt_length"]], ids) for i in long for ids in rows[i]["option_ids"]]
        flat = sequence_loglikelihoods(model, pad, pairs) if pairs else []
        start = 0
        for i in long:
            scores[i] = flat[start : start + len(rows[i]["option_ids"])]
            start += len(rows[i]["option_ids"])
        return {
            "loglikelihoods": scores,
            "option_chars": [row["option_chars"] for row in rows],
            "labels": [row["label"] for row in rows],
            "nll_sum": -sum(ll[row["label"]] for ll, row in zip(scores, rows, strict=True)),
            "count": sum(len(row["option_ids"][row["label"]]) for row in rows),
        }

    def _summarize(self, parts: list[dict[str, Any]]) -> dict[str, float]:
        count = sum(part["count"] for part in parts)
        loss = sum(part["nll_sum"] for part in parts) / count if count else math.nan
        every = {
            **choice_scores([ll for part in parts for ll in part["loglikelihoods"]],
                            [chars for part in parts for chars in part["option_chars"]],
                            [label for part in parts for label in part["labels"]]),
            "loss": loss,
            "perplexity": perplexity(loss) if count else math.nan,
        }
        return {name: every[name] for name in self.metric_names}
