"""Task heads as functions of the base model's last hidden state, using the task model's own modules.

Split learning computes the base model's output in pieces (client bottom, server trunk, client top), so the
loss must start from a hidden state rather than from ``model(...)``. Each head here reproduces what the
task model's ``forward`` does after its base model, looking its modules up by attribute name, so the same
function serves the unsplit model and a split client holding only the top (``ClientTop.head``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import reduce

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from fedlm.errors import UserError

Modules = Mapping[str, nn.Module]
HeadFn = Callable[[Modules, Tensor, Tensor | None, PretrainedConfig], Tensor]

# Family -> attribute names of its MLM head modules on the *ForMaskedLM model, applied in order.
MLM_HEAD_MODULES: dict[str, tuple[str, ...]] = {
    "bert": ("cls",),
    "roberta": ("lm_head",),
    "distilbert": ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"),
}


def _mlm_head(modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig) -> Tensor:
    names = MLM_HEAD_MODULES[config.model_type]
    return reduce(lambda x, name: modules[name](x), names, hidden)


def _lm_head(modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig) -> Tensor:
    return modules["lm_head"](hidden)


def _bert_classifier(modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig) -> Tensor:
    return modules["classifier"](modules["dropout"](modules["pooler"](hidden)))


def _roberta_classifier(modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig) -> Tensor:
    return modules["classifier"](hidden)


def _distilbert_classifier(
    modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig
) -> Tensor:
    return modules["classifier"](modules["dropout"](F.relu(modules["pre_classifier"](hidden[:, 0]))))


def _last_token_classifier(
    modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig
) -> Tensor:
    # GPT2/Llama ForSequenceClassification: score every position, keep the rightmost non-pad token's
    logits = modules["score"](hidden)
    pad_id = config.pad_token_id
    if pad_id is None or input_ids is None:
        if hidden.shape[0] != 1:
            raise ValueError("a decoder classifier needs input_ids and a pad token id to find each row's last token")
        return logits[:, -1]
    non_pad = (input_ids != pad_id).to(logits.device, torch.int32)
    last = (torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32) * non_pad).argmax(-1)
    return logits[torch.arange(hidden.shape[0], device=logits.device), last]


HEADS: dict[str, HeadFn] = {
    "BertForMaskedLM": _mlm_head,
    "RobertaForMaskedLM": _mlm_head,
    "DistilBertForMaskedLM": _mlm_head,
    "GPT2LMHeadModel": _lm_head,
    "LlamaForCausalLM": _lm_head,
    "BertForSequenceClassification": _bert_classifier,
    "RobertaForSequenceClassification": _roberta_classifier,
    "DistilBertForSequenceClassification": _distilbert_classifier,
    "GPT2ForSequenceClassification": _last_token_classifier,
    "LlamaForSequenceClassification": _last_token_classifier,
}


def head_fn(model: PreTrainedModel) -> HeadFn:
    """The head of ``model``'s task class; a one-line error for a class split training does not know."""
    fn = HEADS.get(type(model).__name__)
    if fn is None:
        raise UserError(f"no hidden-state head for {type(model).__name__} (known: {', '.join(HEADS)})")
    return fn


def head_modules(model: PreTrainedModel) -> dict[str, nn.Module]:
    """Base-model children and the task model's own children, by attribute name (what heads look up)."""
    base = model.base_model
    modules = dict(base.named_children())
    if model is not base:
        modules.update({name: child for name, child in model.named_children() if child is not base})
    return modules


def task_logits(model: PreTrainedModel, hidden: Tensor, input_ids: Tensor | None = None) -> Tensor:
    """``model(...).logits`` computed from the base model's last hidden state."""
    return head_fn(model)(head_modules(model), hidden, input_ids, model.config)


def mlm_head(model: PreTrainedModel) -> Callable[[Tensor], Tensor]:
    """The model's hidden-state -> vocabulary-logits MLM head, as one function of (rows x hidden)."""
    names = MLM_HEAD_MODULES.get(model.config.model_type)
    if names is None:
        raise UserError(f"masked LM is not supported for {model.config.model_type!r} models")
    modules = [getattr(model, name) for name in names]
    return lambda hidden: reduce(lambda x, module: module(x), modules, hidden)
