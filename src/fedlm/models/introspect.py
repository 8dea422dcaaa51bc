"""Find a loaded Hugging Face model's parts by looking at the model itself, not at a table of families.

What split learning and the sharing selectors need to know about an architecture:

* the transformer blocks: a ``nn.ModuleList`` inside the base model whose items share one class and hold an
  attention module; an encoder-decoder (t5, bart) has two such lists, encoder then decoder;
* what runs before the blocks (embeddings: every base-model child registered before the one holding the
  blocks) and what runs after (a final norm: a later child whose class is a norm; anything else, such as
  BERT's pooler, belongs to the task head);
* a rotary embedding, if any: a parameter-free child holding an ``inv_freq`` buffer, recomputed by each part;
* whether attention is causal (the attention modules' own ``is_causal`` flag) and which attention kind each
  block uses (``config.layer_types``: full, sliding window, chunked), so each part rebuilds the family's
  masks with ``transformers.masking_utils``.

Families whose blocks are not found this way get one line naming them (:func:`find_layout`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from fedlm.errors import UserError

__all__ = ["BlockStack", "Layout", "block_stacks", "cache_argument", "find_layout", "parameter_groups"]

FULL = "full_attention"
SLIDING = "sliding_attention"
_CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers 5.24 renamed past_key_values to cache


def cache_argument(function: Callable) -> str | None:
    """The name under which ``function`` (an attention layer's forward, a mask builder) takes the key/value
    cache: ``cache`` from transformers 5.24, ``past_key_values`` before; None if it takes none. Asked of the
    function, not of the version, so both spellings keep working."""
    parameters = inspect.signature(function).parameters
    return next((name for name in _CACHE_ARGUMENTS if name in parameters), None)


@dataclass(frozen=True)
class BlockStack:
    """One ``nn.ModuleList`` of blocks: its dotted path inside the base model and its length."""

    path: str
    size: int


@dataclass(frozen=True)
class Layout:
    """Where a decoder-only or encoder-only model keeps its parts (names of base-model children)."""

    blocks: str  # dotted path, under the base model, of the block ModuleList
    embeddings: tuple[str, ...]  # base children that run before block 0 (the client bottom owns them)
    final_norm: tuple[str, ...]  # base children applied after the last block to give ``last_hidden_state``
    rotary: str | None  # parameter-free rotary embedding, recomputed by each part from position ids
    causal: bool
    layer_types: tuple[str, ...]  # attention kind of each block (full, sliding window, ...)
    rotary_per_type: bool  # the rotary module takes a layer type (Gemma 3: local and global RoPE)


def block_stacks(model: nn.Module) -> list[BlockStack]:
    """The block lists of ``model``'s base model, outermost first, in registration order (encoder, decoder)."""
    base = getattr(model, "base_model", model)
    stacks: list[BlockStack] = []
    for name, module in base.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module):
            continue
        if any(name == s.path or name.startswith(s.path + ".") for s in stacks):
            continue  # a list inside a block (e.g. T5's sub-layers) is not a stack of blocks
        if len({type(item) for item in module}) == 1 and _has_attention(module[0]):
            stacks.append(BlockStack(name, len(module)))
    return stacks


def _has_attention(block: nn.Module) -> bool:
    return any(hasattr(m, "is_causal") or "attention" in type(m).__name__.lower() for m in block.modules())


def find_layout(model: PreTrainedModel) -> Layout:
    """The model's cut-relevant parts; one line naming the family when it cannot be cut."""
    family = model.config.model_type
    stacks = block_stacks(model)
    if not stacks:
        raise UserError(f"cannot cut a {family} model: no nn.ModuleList of transformer blocks found in it")
    if len(stacks) > 1 or getattr(model.config, "is_encoder_decoder", False):
        raise UserError(
            f"cannot cut a {family} model: it has {len(stacks)} block stacks "
            f"({', '.join(s.path for s in stacks)}); split learning cuts one stack (encoder-only or decoder-only "
            "models), and an encoder-decoder's decoder reads the encoder's output in every block"
        )
    base = model.base_model
    path = stacks[0].path
    top = path.split(".")[0]
    names = [name for name, _ in base.named_children()]
    rotary = next((n for n, m in base.named_children() if _is_rotary(m)), None)
    before = tuple(n for n in names[: names.index(top)] if n != rotary)
    after = [n for n in names[names.index(top) + 1 :] if n != rotary]
    final_norm = tuple(n for n in after if "norm" in type(getattr(base, n)).__name__.lower())
    blocks = base.get_submodule(path)
    return Layout(
        blocks=path,
        embeddings=before,
        final_norm=final_norm,
        rotary=rotary,
        causal=_is_causal(blocks[0], model.config),
        layer_types=_layer_types(blocks, base.config),
        rotary_per_type=rotary is not None
        and "layer_type" in inspect.signature(getattr(base, rotary).forward).parameters,
    )


def _is_rotary(module: nn.Module) -> bool:
    no_params = next(module.parameters(recurse=True), None) is None
    return no_params and (hasattr(module, "inv_freq") or "rotary" in type(module).__name__.lower())


def _is_causal(block: nn.Module, config: PretrainedConfig) -> bool:
    flags = [bool(m.is_causal) for m in block.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    return any(flags) or bool(getattr(config, "is_decoder", False))


def _layer_types(blocks: nn.ModuleList, config: PretrainedConfig) -> tuple[str, ...]:
    """Each block's attention kind: ``config.layer_types`` where the family has it, else one kind for all
    (sliding window when the config sets a window, as Mistral and Phi-3 do)."""
    declared = getattr(config, "layer_types", None)
    if declared:
        return tuple(declared[: len(blocks)])
    kind = SLIDING if getattr(config, "sliding_window", None) else FULL
    return tuple(getattr(block, "attention_type", kind) for block in blocks)


def parameter_groups(model: nn.Module) -> dict[str, str | int]:
    """Each parameter name -> 'embeddings', its block index counted over all stacks (an encoder's blocks,
    then a decoder's), or 'head' (everything after the blocks: final norm, pooler, task head).

    A parameter belongs to 'embeddings' when its module is the input embedding table or a base-model
    child registered before the first block stack (position / type embeddings, embedding norms and
    projections). Names are as in ``model.named_parameters()``.
    """
    base = getattr(model, "base_model", model)
    stacks = block_stacks(model)
    prefix = _prefix_of(model, base)
    offsets, start = {}, 0
    for stack in stacks:
        offsets[prefix + stack.path + "."] = start
        start += stack.size
    embedding_prefixes = _embedding_prefixes(model, base, prefix, stacks)
    groups: dict[str, str | int] = {}
    for name, _ in model.named_parameters():
        groups[name] = _group(name, offsets, embedding_prefixes, prefix)
    return groups


def _group(name: str, offsets: dict[str, int], embedding_prefixes: tuple[str, ...], base: str) -> str | int:
    for stack, offset in offsets.items():
        if name.startswith(stack):
            return offset + int(name[len(stack) :].split(".")[0])
    if name.startswith(embedding_prefixes):
        return "embeddings"
    # an embedding module registered after its stack (BART's layernorm_embedding) still says what it is
    if name.startswith(base) and any("embed" in part for part in name[len(base) :].split(".")[:-1]):
        return "embeddings"
    return "head"


def _prefix_of(model: nn.Module, base: nn.Module) -> str:
    if base is model:
        return ""
    for name, module in model.named_modules():
        if module is base:
            return name + "."
    return ""


def _embedding_prefixes(model: nn.Module, base: nn.Module, prefix: str, stacks: list[BlockStack]) -> tuple[str, ...]:
    """Module prefixes that hold embeddings: the input embedding table wherever it sits, and every module
    registered before a block stack beside it (base children before the first stack; an encoder's or
    decoder's own position embeddings before its stack)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    found = [name + "." for name, module in model.named_modules() if embeddings is not None and module is embeddings]
    if not stacks:
        return tuple(found)
    names = [name for name, _ in base.named_children()]
    found += [prefix + n + "." for n in names[: names.index(stacks[0].path.split(".")[0])]]
    for stack in stacks:
        parent, _, last = stack.path.rpartition(".")
        if parent:
            children = [name for name, _ in base.get_submodule(parent).named_children()]
            found += [f"{prefix}{parent}.{child}." for child in children[: children.index(last)]]
    return tuple(found)
