"""Adapters on a frozen base model, built with ``peft``: LoRA, IA3, prefix tuning and P-Tuning v2.

The model fedlm trains and sends stays the ``transformers`` model itself, with peft's layers inside it:

* LoRA and IA3 replace their target layers in place, so adapter parameters keep the model's own paths
  (``bert.encoder.layer.3.attention.self.query.lora_A.default.weight``). Everything that works on named
  parameters therefore works unchanged: peft freezes the base, so the trainable names, and with them what
  a round sends and counts, are the adapter's (plus the task head's, ``train_head``); sharing selectors and
  ``critical_layer`` find each adapter tensor's block by its name; a split cut gives each side the adapters
  inside its own blocks.
* Prefix tuning and P-Tuning v2: peft builds the prefixes of all blocks in ``PeftModel.forward``, which
  fedlm's tasks do not call (they read the base model's hidden state), from one prompt encoder outside the
  model. fedlm gives each block's attention its own prefix instead (:mod:`fedlm.models.prefixes`:
  ``model.layers.3.self_attn.prefix_kv.weight``), fed by a hook on that attention layer, so a prefix too is
  found by its block: sharing selectors, ``critical_layer`` and split cuts divide P-Tuning v2 by block. The
  prefix kind's projection MLP (shared by all blocks) stays one module outside them (``prompt_encoder``).

The ``PeftModel`` is kept beside the model (:class:`Adapter`) for ``save_pretrained`` and merging; before
saving, the blocks' prefixes are gathered back into peft's prompt embedding, so ``model/`` is a plain peft
prefix-tuning adapter (``PeftModel.from_pretrained`` loads it; see :mod:`fedlm.models.prefixes` for the
positions it numbers differently).

FedAvg of LoRA factors averages A and B separately: a client's update is (alpha / r) B_k A_k, and the
aggregate's is (alpha / r) mean(B) mean(A), which is not mean(B_k A_k) once the clients' factors differ.
That is what FedAvg on LoRA (as in FlowerTune and OpenFedLLM) does; it is exact only while every client
changes just one of the two factors (e.g. the first round from B = 0 with one local step).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import (
    IA3Config,
    LoraConfig,
    PeftConfig,
    PeftModel,
    PrefixTuningConfig,
    get_peft_model,
    load_peft_weights,
    set_peft_model_state_dict,
)
from peft.utils import (
    TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING,
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
)
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from fedlm.config import AdapterConfig
from fedlm.errors import UserError
from fedlm.models.prefixes import attach_prefixes, attention_modules, gather_prefixes, scatter_prefixes

__all__ = ["PREFIX_KINDS", "Adapter", "apply_adapter", "head_module_names", "linear_block_modules"]

log = logging.getLogger("fedlm")

PREFIX_KINDS = ("prefix", "p_tuning_v2")
HEAD_TASKS = ("classification", "regression", "tagging", "qa")  # heads of their own, not tied to embeddings
_IN_BLOCK = re.compile(r"\.\d+\.")  # a dotted name inside a numbered ModuleList entry: a transformer block
# peft's own default targets per model_type, where it has them
_PEFT_DEFAULTS = {"lora": TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING,
                  "ia3": TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING}


@dataclass
class Adapter:
    """A model's adapter: the peft wrapper (for saving) around the model fedlm trains (``model``)."""

    kind: str
    peft_model: PeftModel
    save_merged: bool = False

    @property
    def model(self) -> PreTrainedModel:
        """The transformers model with the adapter inside: what runs, trains and is cut."""
        return self.peft_model.get_base_model()

    def trainable_names(self) -> list[str]:
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def load(self, path: Path) -> None:
        """Weights written by :meth:`save` back into this adapter (built from the same spec on the same base),
        a P-Tuning v2 prefix into its blocks."""
        if self.kind == "prefix" and self.peft_model.peft_config[self.peft_model.active_adapter].prefix_projection:
            raise UserError(f"{path}: a projected prefix is saved as the MLP's output, not the MLP; load it with "
                            "peft's PeftModel.from_pretrained (inference only)")
        set_peft_model_state_dict(self.peft_model, load_peft_weights(str(path)))
        if self.kind in PREFIX_KINDS:
            scatter_prefixes(self.peft_model, self.model)

    def save(self, path: Path) -> None:
        """The adapter (and trained head) with peft's ``save_pretrained``; with ``save_merged``, also the base
        with the adapter folded into its weights, a plain transformers model, in ``path/merged``."""
        if self.kind in PREFIX_KINDS:
            gather_prefixes(self.peft_model, self.model)
        self.peft_model.save_pretrained(path)
        if self.save_merged:
            merged = copy.deepcopy(self.peft_model).merge_and_unload()
            merged.save_pretrained(Path(path) / "merged")


def apply_adapter(spec: AdapterConfig, model: PreTrainedModel, task: str, seed: int = 0) -> Adapter:
    """Freeze ``model`` and add the adapter ``spec`` describes (initialised from ``seed``) in place."""
    train_head = spec.train_head if spec.train_head is not None else task in HEAD_TASKS
    if train_head and task not in HEAD_TASKS:
        raise UserError(f"adapter.train_head is for the heads of {', '.join(HEAD_TASKS)}; a {task} head is tied "
                        "to the input embeddings (set adapter.train_head: false)")
    if spec.kind in PREFIX_KINDS and getattr(model.config, "is_encoder_decoder", False):
        raise UserError(f"adapter.kind {spec.kind} is for encoder-only and decoder-only models, not the "
                        f"encoder-decoder {model.config.model_type}; use adapter.kind lora or ia3")
    if spec.kind in PREFIX_KINDS:
        attention_modules(model, spec.kind)  # a family with nowhere to put prefixes: one line, before peft's
    head = head_module_names(model) if train_head else None
    config = _peft_config(spec, model, head)
    with _seeded(seed):
        try:
            peft_model = get_peft_model(model, config)
        except ValueError as exc:  # peft: no default targets for this family, or targets that are not there
            reason = " ".join(str(exc).split())
            raise UserError(f"adapter.kind {spec.kind} on a {model.config.model_type} model: {reason} "
                            "(set adapter.target_modules to module names of this model, or all-linear)") from None
    if spec.kind in PREFIX_KINDS:
        attach_prefixes(peft_model, model, spec.kind)
    return Adapter(spec.kind, peft_model, spec.save_merged)


def _peft_config(spec: AdapterConfig, model: PreTrainedModel, head: list[str] | None) -> PeftConfig:
    targets: Any = spec.target_modules
    if targets is None and spec.kind in _PEFT_DEFAULTS:
        targets = _default_targets(spec.kind, model)
    if targets == "all-linear":
        targets = linear_block_modules(model)
    transposed = any(isinstance(m, Conv1D) for m in model.modules())  # GPT-2 stores its linears as (in, out)
    if spec.kind == "lora":
        return LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                          fan_in_fan_out=transposed, modules_to_save=head)
    if spec.kind == "ia3":
        feedforward = spec.feedforward_modules
        if targets is not None and feedforward is None:
            feedforward = []  # peft's default feed-forward names need not be among the chosen targets
        return IA3Config(target_modules=targets, feedforward_modules=feedforward, fan_in_fan_out=transposed,
                         modules_to_save=head)
    projection = spec.kind == "prefix" and spec.projection
    return PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=spec.prefix_length,
                              prefix_projection=projection,
                              encoder_hidden_size=spec.projection_size or model.config.hidden_size,
                              modules_to_save=head)


def _default_targets(kind: str, model: PreTrainedModel) -> str | None:
    """``target_modules: null``: peft's default for the family (bert's query and value, llama's q_proj and
    v_proj ...), so that the families it knows adapt what they always have; where peft has none, or names
    modules this model lacks (olmo2, modernbert, phi3, distilbert ...), every linear layer in the blocks
    (``all-linear``), which every family with blocks has."""
    model_type = model.config.model_type
    names = _PEFT_DEFAULTS[kind].get(model_type)
    modules = [name for name, _ in model.named_modules()]
    if names and all(any(m == n or m.endswith(f".{n}") for m in modules) for n in names):
        return None  # peft's own default
    log.info("adapter.kind %s on a %s model: peft has no default target_modules for this family; adapting every "
             "linear layer in the blocks (all-linear)", kind, model_type)
    return "all-linear"


def linear_block_modules(model: torch.nn.Module) -> list[str]:
    """``all-linear``: every linear layer inside the transformer blocks (never the head nor the embeddings)."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear | Conv1D) and _IN_BLOCK.search(f".{name}.")]
    if not names:
        raise UserError(f"adapter.target_modules all-linear: no linear layer inside the blocks of this "
                        f"{type(model).__name__}; name the modules to adapt")
    return names


def head_module_names(model: PreTrainedModel) -> list[str]:
    """The task head, by module name: the task model's own modules besides its base model, and the base's
    pooler (a sentence classifier's head in BERT-style models); these train and travel with the adapter."""
    base = model.base_model
    names = [name for name, child in model.named_children() if child is not base and _has_parameters(child)]
    pooler = getattr(base, "pooler", None)
    if base is not model and pooler is not None and _has_parameters(pooler):
        names.append(f"{model.base_model_prefix}.pooler")
    if not names:
        raise UserError(f"adapter.train_head: {type(model).__name__} has no task head; set adapter.train_head: false")
    return names


def _has_parameters(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed the adapter's initialisation without disturbing the caller's global RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
