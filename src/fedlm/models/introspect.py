"""Find a loaded Hugging Face model's parts by looking at the model itself, not at a table of families.

What split learning and the sharing selectors need to know about an architecture:

* the transformer blocks: a ``nn.ModuleList`` inside the base model whose items share one class and hold an
  attention module; an encoder-decoder (t5, bart) has two such lists, encoder then decoder;
* what runs before the blocks (embeddings: every base-model child registered before the one holding the
  blocks) and what runs after (a final norm: a later child whose class is a norm; anything else, such as
  BERT's pooler, belongs to the task head). When the blocks sit in a container of their own (OPT's
  ``decoder``, DeBERTa's ``encoder``), the container's other children are sorted by where its ``forward``
  uses them, since registration order does not say (OPT registers its final norm before its layers): before
  the loop over the blocks (embeddings), after it (final norm and projection), or between the blocks
  (``shared``: DeBERTa's relative position embeddings, which every block reads);
* a rotary embedding, if any: a parameter-free child holding an ``inv_freq`` buffer, recomputed by each part;
* whether attention is causal (the attention modules' own ``is_causal`` flag) and which attention kind each
  block uses (``config.layer_types``: full, sliding window, chunked), so each part rebuilds the family's
  masks with ``transformers.masking_utils``.

Families whose blocks are not found this way get one line naming them (:func:`find_layout`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from fedlm.errors import UserError

__all__ = ["BlockStack", "Layout", "block_stacks", "cache_argument", "find_layout", "parameter_groups",
           "self_attributes"]

FULL = "full_attention"
SLIDING = "sliding_attention"
# transformers 5.24 renamed past_key_values to cache; GPT-NeoX's and Falcon's attention call theirs layer_past
_CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def cache_argument(function: Callable) -> str | None:
    """The name under which ``function`` (an attention layer's forward, a mask builder) takes the key/value
    cache: ``cache`` from transformers 5.24, ``past_key_values`` before, ``layer_past`` in GPT-NeoX and Falcon
    attention; None if it takes none. Asked of the function, not of the version or the family, so every
    spelling keeps working."""
    parameters = inspect.signature(function).parameters
    return next((name for name in _CACHE_ARGUMENTS if name in parameters), None)


@dataclass(frozen=True)
class BlockStack:
    """One ``nn.ModuleList`` of blocks: its dotted path inside the base model and its length."""

    path: str
    size: int


@dataclass(frozen=True)
class Layout:
    """Where a decoder-only or encoder-only model keeps its parts (dotted paths under the base model)."""

    blocks: str  # dotted path, under the base model, of the block ModuleList
    embeddings: tuple[str, ...]  # dotted paths of the modules that run before block 0 (the client bottom owns them)
    final_norm: tuple[str, ...]  # dotted paths of the modules applied, in order, after the last block to give
    # ``last_hidden_state`` (a final norm; OPT's also a projection)
    rotary: str | None  # parameter-free rotary embedding, recomputed by each part from position ids
    causal: bool
    layer_types: tuple[str, ...]  # attention kind of each block (full, sliding window, ...)
    rotary_per_type: bool  # the rotary module takes a layer type (Gemma 3: local and global RoPE)
    shared: tuple[str, ...] = ()  # dotted paths of the blocks' container's modules used between its blocks
    container: str = ""  # dotted path of the module whose ``forward`` loops over the blocks ("": the base model)


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
    before = [n for n in names[: names.index(top)] if n != rotary]
    after = [n for n in names[names.index(top) + 1 :] if n != rotary]
    final_norm = [n for n in after if "norm" in type(getattr(base, n)).__name__.lower()]
    container, _, stack = path.rpartition(".")
    shared: list[str] = []
    if container:
        inner_before, inner_after, shared = _uses_around(base.get_submodule(container), stack)
        before += [f"{container}.{n}" for n in inner_before]
        final_norm = [f"{container}.{n}" for n in inner_after] + final_norm
        shared = [f"{container}.{n}" for n in shared]
    blocks = base.get_submodule(path)
    return Layout(
        blocks=path,
        embeddings=tuple(before),
        final_norm=tuple(final_norm),
        rotary=rotary,
        causal=_is_causal(blocks[0], model.config),
        layer_types=_layer_types(blocks, base.config),
        rotary_per_type=rotary is not None
        and "layer_type" in inspect.signature(getattr(base, rotary).forward).parameters,
        shared=tuple(shared),
        container=container,
    )


def _uses_around(container: nn.Module, stack: str) -> tuple[list[str], list[str], list[str]]:
    """``container``'s children other than its block list ``stack``, by where its ``forward`` uses them: before
    the loop over the blocks, after it (each in order of first use), and the rest (used inside the loop, only
    through other methods, or not at all: the blocks' own shared inputs). Read from the source, because
    registration order does not say (OPT's decoder registers its final norm before its layers); without
    source, registration order stands in."""
    children = [name for name, _ in container.named_children() if name != stack]
    uses = _self_attribute_lines(type(container).forward)
    loop = _loop_lines(type(container).forward, stack)
    if uses is None or loop is None:
        order = [name for name, _ in container.named_children()]
        return ([n for n in children if order.index(n) < order.index(stack)],
                [n for n in children if order.index(n) > order.index(stack)], [])
    first, last = loop
    lines = {name: min((line for line in uses.get(name, ()) if not first <= line <= last), default=None)
             for name in children}
    inside = {name for name in children if any(first <= line <= last for line in uses.get(name, ()))}
    before = sorted((n for n in children if n not in inside and lines[n] is not None and lines[n] < first),
                    key=lambda n: lines[n])
    after = sorted((n for n in children if n not in inside and lines[n] is not None and lines[n] > last),
                   key=lambda n: lines[n])
    return before, after, [n for n in children if n not in before and n not in after]


def _parsed(function: Callable) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


def _self_attribute_lines(function: Callable) -> dict[str, list[int]] | None:
    """Each ``self.<name>`` that ``function`` reads -> the source lines that read it; None without source."""
    tree = _parsed(function)
    if tree is None:
        return None
    lines: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            lines.setdefault(node.attr, []).append(node.lineno)
    return lines


def self_attributes(function: Callable) -> set[str]:
    """The ``self.<name>`` attributes ``function`` reads (empty without source)."""
    return set(_self_attribute_lines(function) or {})


def _loop_lines(function: Callable, stack: str) -> tuple[int, int] | None:
    """First and last source line of ``function``'s ``for`` loop over ``self.<stack>``; None if it has none."""
    tree = _parsed(function)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.For) and any(
            isinstance(sub, ast.Attribute) and sub.attr == stack and isinstance(sub.value, ast.Name)
            and sub.value.id == "self" for sub in ast.walk(node.iter)
        ):
            return node.lineno, node.end_lineno or node.lineno
    return None


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
    """Module prefixes that hold embeddings: the input embedding table wherever it sits, base children
    registered before the first block stack, and the modules a stack's own container uses before its loop over
    the blocks (an encoder's or decoder's own position embeddings; not OPT's final norm, registered earlier)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    found = [name + "." for name, module in model.named_modules() if embeddings is not None and module is embeddings]
    if not stacks:
        return tuple(found)
    names = [name for name, _ in base.named_children()]
    found += [prefix + n + "." for n in names[: names.index(stacks[0].path.split(".")[0])]]
    for stack in stacks:
        parent, _, last = stack.path.rpartition(".")
        if parent:
            before, _, _ = _uses_around(base.get_submodule(parent), last)
            found += [f"{prefix}{parent}.{child}." for child in before]
    return tuple(found)
