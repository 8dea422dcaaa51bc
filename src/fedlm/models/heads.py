"""Task heads as functions of the base model's last hidden state, using the task model's own modules.

Split learning computes the base model's output in pieces (client bottom, server trunk, client top), so the
loss must start from a hidden state rather than from ``model(...)``. Each head here reproduces what the
task model's ``forward`` does after its base model, looking its modules up by attribute name, so the same
function serves the unsplit model and a split client holding only the top (``ClientTop.head``).

Heads are found by the task class's kind (``*ForCausalLM``, ``*ForMaskedLM``, ``*ForSequenceClassification``)
and the modules it has, so any family's model gets one (:func:`find_head`); ``HEADS`` lists the task classes
whose head is not one of those shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial, reduce

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from fedlm.errors import UserError

Modules = Mapping[str, nn.Module]
HeadFn = Callable[[Modules, Tensor, Tensor | None, PretrainedConfig], Tensor]

# A *ForMaskedLM's head is its own children with parameters, in registration order (bert's cls, roberta's
# lm_head, electra's generator_predictions then generator_lm_head). DistilBERT's forward also applies a
# parameter-free activation between two of them, so its order is spelled out.
MLM_HEAD_MODULES: dict[str, tuple[str, ...]] = {
    "distilbert": ("vocab_transform", "activation", "vocab_layer_norm", "vocab_projector"),
}


def mlm_head_names(model: PreTrainedModel) -> tuple[str, ...]:
    """Attribute names of the masked-LM head modules on a *ForMaskedLM model, in the order they apply."""
    if model.config.model_type in MLM_HEAD_MODULES:
        return MLM_HEAD_MODULES[model.config.model_type]
    base = model.base_model
    return tuple(
        name for name, child in model.named_children()
        if child is not base and next(child.parameters(), None) is not None
    )


def _mlm_head(
    names: tuple[str, ...], modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig
) -> Tensor:
    return reduce(lambda x, name: modules[name](x), names, hidden)


def _lm_head(
    name: str, modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig
) -> Tensor:
    # *ForCausalLM: the output embeddings, then the family's logit soft-capping if its config sets one (Gemma)
    logits = modules[name](hidden)
    cap = getattr(config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def _sequence_classifier(
    modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig
) -> Tensor:
    """*ForSequenceClassification by the modules it has: a decoder's ``score`` reads each row's last token;
    a pooler (bert) or a ``pre_classifier`` (distilbert) feed the classifier; otherwise the classifier takes
    the hidden states itself (roberta, electra: their heads read the first token)."""
    if "score" in modules:
        return _last_token_classifier(modules, hidden, input_ids, config)
    if "head" in modules and "drop" in modules:
        return _pooled_head_classifier(modules, hidden, input_ids, config)
    if getattr(config, "classifier_pooling", "first") == "mean":
        return _mean_pooled_classifier(modules, hidden, input_ids, config)
    if "pooler" in modules:
        return _bert_classifier(modules, hidden, input_ids, config)
    if "pre_classifier" in modules:
        return _distilbert_classifier(modules, hidden, input_ids, config)
    return _roberta_classifier(modules, hidden, input_ids, config)


def _mean_pooled_classifier(
    modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig
) -> Tensor:
    """An encoder's classifier on the mean of its non-pad token states instead of its first token's (how
    sentence-transformers checkpoints were trained to pool; ``model.pooling: mean``). BERT's pooler is skipped:
    it was trained on the first token only."""
    mean = _token_mean(hidden, input_ids, config)
    if "pooler" in modules:
        return modules["classifier"](modules["dropout"](mean))
    if "pre_classifier" in modules:
        return modules["classifier"](modules["dropout"](F.relu(modules["pre_classifier"](mean))))
    return modules["classifier"](mean.unsqueeze(1))  # heads that read the first position get the mean there


def _token_mean(hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig) -> Tensor:
    """The mean of each row's non-pad token states."""
    if input_ids is None or config.pad_token_id is None:
        raise ValueError("mean pooling needs input_ids and a pad token id to leave padding out of the mean")
    mask = (input_ids != config.pad_token_id).to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def _pooled_head_classifier(
    modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig
) -> Tensor:
    """ModernBERT's classifier: the first token's state (``classifier_pooling: cls``) or the mean of the non-pad
    states (``mean``), through its prediction head, dropout and the linear classifier."""
    pooled = _token_mean(hidden, input_ids, config) if getattr(config, "classifier_pooling", "cls") == "mean" \
        else hidden[:, 0]
    return modules["classifier"](modules["drop"](modules["head"](pooled)))


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


def _token_classifier(modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig) -> Tensor:
    # *ForTokenClassification: dropout, then a linear layer at every position (Llama names it score)
    linear = modules["classifier"] if "classifier" in modules else modules["score"]
    return linear(modules["dropout"](hidden))


def _span_head(modules: Modules, hidden: Tensor, input_ids: Tensor | None, config: PretrainedConfig) -> Tensor:
    # *ForQuestionAnswering: start and end logits as the last axis (batch, seq, 2); DistilBERT adds dropout
    if "dropout" in modules:
        hidden = modules["dropout"](hidden)
    return modules["qa_outputs"](hidden)


_SPAN_FAMILIES = ("Bert", "Roberta", "DistilBert", "GPT2", "Llama")  # class-name prefixes of per-token heads
HEADS: dict[str, HeadFn] = {
    **{f"{name}ForTokenClassification": _token_classifier for name in _SPAN_FAMILIES},
    **{f"{name}ForQuestionAnswering": _span_head for name in _SPAN_FAMILIES},
}


def find_head(model: PreTrainedModel) -> HeadFn | None:
    """The head of ``model``'s task class: listed in ``HEADS``, or found by its kind; None if neither."""
    name = type(model).__name__
    if name in HEADS:
        return HEADS[name]
    if name.endswith("ForSequenceClassification"):
        return _sequence_classifier
    if name.endswith("ForMaskedLM"):
        return partial(_mlm_head, mlm_head_names(model))
    if name.endswith(("ForCausalLM", "LMHeadModel")) and model.get_output_embeddings() is not None:
        output = model.get_output_embeddings()
        return partial(_lm_head, next(n for n, child in model.named_children() if child is output))
    return None


def head_fn(model: PreTrainedModel) -> HeadFn:
    """The head of ``model``'s task class; a one-line error for a class split training does not know."""
    fn = find_head(model)
    if fn is None:
        raise UserError(f"no hidden-state head for {type(model).__name__} (known: causal LM, masked LM, "
                        f"sequence classification, {', '.join(HEADS)})")
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


def pools_outside_forward(model: PreTrainedModel) -> bool:
    """True where the classifier mean-pools in fedlm's head while the family's own forward would read the first
    token (BERT, DistilBERT with ``model.pooling: mean``): its logits must come from ``task_logits``, not from
    ``model(...)``. ModernBERT pools by its own config in its own forward."""
    if getattr(model.config, "classifier_pooling", "first") != "mean":
        return False
    modules = head_modules(model)
    return not ("head" in modules and "drop" in modules)


def mlm_head(model: PreTrainedModel) -> Callable[[Tensor], Tensor]:
    """The model's hidden-state -> vocabulary-logits MLM head, as one function of (rows x hidden)."""
    if not type(model).__name__.endswith("ForMaskedLM"):
        raise UserError(f"masked LM is not supported for {model.config.model_type!r} models")
    modules = [getattr(model, name) for name in mlm_head_names(model)]
    return lambda hidden: reduce(lambda x, module: module(x), modules, hidden)
