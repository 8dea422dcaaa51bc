"""Per-block prefixes for prefix tuning and P-Tuning v2: each attention layer holds and feeds its own.

P-Tuning v2 prepends P trainable key/value vectors ("deep prompts") to the keys and values of every
attention layer. peft keeps the prefixes of all layers in one prompt encoder outside the model and passes
them as a key/value cache to the whole model's forward; fedlm instead gives each block's self-attention
module its own prefix, ``<attention>.prefix_kv.weight`` (P x 2 * key/value heads * head dim, the block's
slice of peft's prompt embedding), and a forward pre-hook on that module that adds it. Why:

* a parameter's name says its block (``model.layers.3.self_attn.prefix_kv.weight``), so sharing
  selectors and ``critical_layer`` pick each block's prefix with its block, and a split cut gives the
  client the prefixes of its bottom and top blocks and the server those of the trunk's blocks;
* the hook needs nothing from outside its block, so a block run by the base model's forward, by a split
  part (:mod:`fedlm.models.cut`) or inside ``generate`` sees the same prefix.

What the hook does (as ChatGLM's P-Tuning v2, FL-GLM's base, does): the attention's cache is wrapped so
that the keys/values it attends to are ``[prefix; tokens]``, and its 4-D attention mask gets P leading
columns that every token sees (an sdpa call that would have relied on ``is_causal`` gets an explicit mask).
The tokens keep their own positions 0..n-1 and a real cache (generation) never holds the prefix. Two
differences from ``PeftModel.forward``, which passes the prefixes as a cache of P earlier tokens: peft
numbers the real tokens from P (absolute position embeddings and rotary angles shift by P), and in a
sliding-window layer peft's prefix drops out of view for tokens farther than the window from it; here the
prefix is always visible. Given ``position_ids = 0..n-1`` and no window shorter than the input, the two
compute the same (``tests/test_adapters.py`` checks it).

``prefix`` with a projection produces every block's prefix with one MLP from one embedding (peft's
``PrefixEncoder``); that MLP stays outside the blocks (``prompt_encoder``), each block's hook computing its
own slice of the MLP's output, so it is not divisible by block (sharing counts it with the head, and split
runs refuse it).
"""

from __future__ import annotations

import inspect

import torch
from peft import PeftModel
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.cache_utils import EncoderDecoderCache

from fedlm.errors import UserError
from fedlm.models.introspect import cache_argument

__all__ = ["PREFIX_NAME", "BlockPrefix", "ProjectedPrefix", "attach_prefixes", "attention_modules",
           "gather_prefixes", "scatter_prefixes", "widen_mask"]

PREFIX_NAME = "prefix_kv"  # the submodule each attention layer gets: ``<attention>.prefix_kv``
_ATTENTION_KERNELS = ("eager", "sdpa")  # kernels that take a 4-D mask this module can widen


class BlockPrefix(nn.Embedding):
    """One attention layer's P virtual tokens: row i holds token i's key and value, (2, heads, head dim)
    flattened, as in peft's prompt embedding. An embedding looked up per example (rather than one tensor
    broadcast over the batch) so that per-example gradient tools (Opacus) see an ordinary layer."""

    def __init__(self, length: int, heads: int, head_dim: int) -> None:
        width = 2 * heads * head_dim
        super().__init__(length, width, _weight=torch.zeros(length, width))  # set from peft's initialisation
        self.heads, self.head_dim = heads, head_dim

    def keys_values(self, batch: int) -> tuple[Tensor, Tensor]:
        """(batch, heads, P, head dim) keys and values."""
        tokens = torch.arange(self.num_embeddings, device=self.weight.device).expand(batch, -1)
        return _split(self(tokens), self.heads, self.head_dim)


class ProjectedPrefix(nn.Module):
    """One layer's slice of a shared prefix MLP's output (``prefix`` with a projection). Holds no parameters:
    the MLP is the model's ``prompt_encoder``, referenced here, not owned."""

    def __init__(self, encoder: nn.Module, layer: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self._encoder = (encoder,)  # a tuple: not registered, so its parameters keep their one name
        self.layer, self.heads, self.head_dim = layer, heads, head_dim

    def keys_values(self, batch: int) -> tuple[Tensor, Tensor]:
        encoder = self._encoder[0]
        width = 2 * self.heads * self.head_dim
        rows = slice(self.layer * width, (self.layer + 1) * width)
        first, act, last = encoder.transform
        tokens = torch.arange(encoder.embedding.num_embeddings, device=encoder.embedding.weight.device)
        hidden = act(first(encoder.embedding(tokens.expand(batch, -1))))
        return _split(nn.functional.linear(hidden, last.weight[rows], last.bias[rows]), self.heads, self.head_dim)


def _split(rows: Tensor, heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    batch, length, _ = rows.shape
    kv = rows.view(batch, length, 2, heads, head_dim)
    return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def attention_modules(model: PreTrainedModel, kind: str) -> list[nn.Module]:
    """Every self-attention layer that keeps a key/value cache (a ``layer_idx``, a cache argument and an
    ``attention_mask`` argument), innermost, in layer order; a family without one gets one line."""
    found = [m for m in model.modules() if _caches(m)]
    inner = [m for m in found if not any(_caches(sub) for sub in m.modules() if sub is not m)]
    if not inner:
        raise UserError(f"adapter.kind {kind} on a {model.config.model_type} model: its attention layers take no "
                        "past keys/values, so there is nowhere to put prefixes; use adapter.kind lora or ia3")
    kernel = model.config._attn_implementation
    if kernel not in _ATTENTION_KERNELS:
        raise UserError(f"adapter.kind {kind} needs the eager or sdpa attention kernel, this model runs {kernel} "
                        "(load it with attn_implementation sdpa)")
    return sorted(inner, key=lambda m: m.layer_idx)


def _caches(module: nn.Module) -> bool:
    if not isinstance(getattr(module, "layer_idx", None), int) or getattr(module, "is_cross_attention", False):
        return False
    forward = module.forward
    return "attention_mask" in inspect.signature(forward).parameters and cache_argument(forward) is not None


def attach_prefixes(peft_model: PeftModel, model: PreTrainedModel, kind: str) -> None:
    """Give each attention layer of ``model`` its prefix, initialised as peft initialised its prompt encoder,
    and the hook that feeds it. With a projection the encoder becomes the model's ``prompt_encoder``."""
    config = peft_model.peft_config[peft_model.active_adapter]
    layers = attention_modules(model, kind)
    if len(layers) != config.num_layers:
        raise UserError(f"adapter.kind {kind}: found {len(layers)} attention layers in this "
                        f"{model.config.model_type} model but it declares {config.num_layers}")
    heads = config.num_attention_heads
    head_dim = config.token_dim // heads
    encoder = peft_model.prompt_encoder[peft_model.active_adapter]
    if config.prefix_projection:
        model.add_module("prompt_encoder", peft_model.prompt_encoder)
    for attention in layers:
        if config.prefix_projection:
            prefix: nn.Module = ProjectedPrefix(encoder, attention.layer_idx, heads, head_dim)
        else:
            prefix = BlockPrefix(config.num_virtual_tokens, heads, head_dim).to(encoder.embedding.weight.device)
        attention.add_module(PREFIX_NAME, prefix)
        attention.register_forward_pre_hook(_add_prefix, with_kwargs=True)
    scatter_prefixes(peft_model, model)
    _probe(model, kind)


def _probe(model: PreTrainedModel, kind: str) -> None:
    """One forward of two tokens with the prefixes in place, so that a family whose attention cannot take them
    (another cache shape than the prefixes', Falcon's eager ALiBi bias) is refused now, in one line, and not at
    the first training step."""
    was_training = model.training
    device = model.get_input_embeddings().weight.device
    model.eval()  # no dropout: the probe draws no random numbers
    try:
        with torch.no_grad():
            model(input_ids=torch.ones(1, 2, dtype=torch.long, device=device))
    except UserError:
        raise
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise UserError(f"adapter.kind {kind} on a {model.config.model_type} model: its attention fails with the "
                        f"prefixes in place ({reason}); use adapter.kind lora or ia3") from exc
    finally:
        model.train(was_training)


def _block_prefixes(model: nn.Module) -> list[BlockPrefix]:
    prefixed = sorted((m for m in model.modules() if isinstance(getattr(m, PREFIX_NAME, None), BlockPrefix)),
                      key=lambda m: m.layer_idx)
    return [getattr(m, PREFIX_NAME) for m in prefixed]


def scatter_prefixes(peft_model: PeftModel, model: PreTrainedModel) -> None:
    """Each block's slice of peft's prompt embedding (P x layers * 2 * width) into the block's prefix."""
    embedding = peft_model.prompt_encoder[peft_model.active_adapter].embedding.weight
    start = 0
    with torch.no_grad():
        for prefix in _block_prefixes(model):
            prefix.weight.copy_(embedding[:, start : start + prefix.embedding_dim])
            start += prefix.embedding_dim


def gather_prefixes(peft_model: PeftModel, model: PreTrainedModel) -> None:
    """The blocks' prefixes back into peft's prompt embedding, the layout ``save_pretrained`` writes and
    ``PeftModel.from_pretrained`` reads (a projected prefix is peft's own encoder already)."""
    blocks = _block_prefixes(model)
    if blocks:
        embedding = peft_model.prompt_encoder[peft_model.active_adapter].embedding
        with torch.no_grad():
            embedding.weight.copy_(torch.cat([b.weight for b in blocks], dim=1))


# ------------------------------------------------------------------------------------------------ the hook


class _PrefixedCache:
    """What the attention layer sees as its cache: ``update`` returns ``[prefix; past; new]`` keys/values,
    the past and new ones kept (during generation) by the real cache, which never holds the prefix."""

    def __init__(self, keys: Tensor, values: Tensor, inner: object | None, family: str) -> None:
        self.keys, self.values, self.inner, self.family = keys, values, inner, family

    def update(self, keys: Tensor, values: Tensor, *args: object, **kwargs: object) -> tuple:
        """The layer index and cache kwargs pass through as the layer gave them (their spelling varies across
        transformers versions: ``cache_kwargs`` positional before 5.24, ``kwargs=`` since)."""
        if keys.shape[1] != self.keys.shape[1] or keys.shape[3] != self.keys.shape[3]:
            # peft sizes prefixes by the config's (key/value) heads; Falcon-7B's multi-query attention caches one
            raise UserError(
                f"prefix tuning on a {self.family} model: its attention caches {keys.shape[1]} key/value head(s) "
                f"of {keys.shape[3]} dims, but the prefixes were sized for {self.keys.shape[1]} of "
                f"{self.keys.shape[3]} from its config; use adapter.kind lora or ia3")
        if self.inner is not None:
            keys, values = self.inner.update(keys, values, *args, **kwargs)
        prefix_k, prefix_v = self.keys.to(keys.dtype), self.values.to(values.dtype)
        return torch.cat([prefix_k, keys], dim=2), torch.cat([prefix_v, values], dim=2)


_SIGNATURES: dict[type, tuple[inspect.Signature, str]] = {}  # attention class -> forward's signature, cache name


def _add_prefix(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of an attention layer: its prefix as leading cached keys/values, visible to all."""
    if type(module) not in _SIGNATURES:
        _SIGNATURES[type(module)] = inspect.signature(module.forward), cache_argument(module.forward)
    signature, cache = _SIGNATURES[type(module)]
    bound = signature.bind_partial(*args, **kwargs)
    hidden = bound.arguments[next(iter(signature.parameters))]
    keys, values = getattr(module, PREFIX_NAME).keys_values(hidden.shape[0])
    inner = bound.arguments.get(cache)
    if isinstance(inner, EncoderDecoderCache):
        inner = inner.self_attention_cache
    past = inner.get_seq_length(module.layer_idx) if inner is not None else 0
    family = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    bound.arguments[cache] = _PrefixedCache(keys, values, inner, family)
    bound.arguments["attention_mask"] = widen_mask(
        bound.arguments.get("attention_mask"), keys.shape[2], hidden.shape[1], past,
        causal=bool(getattr(module, "is_causal", False)), eager=module.config._attn_implementation == "eager",
        like=hidden)
    return bound.args, bound.kwargs


def widen_mask(mask: Tensor | None, length: int, queries: int, past: int, *, causal: bool, eager: bool,
               like: Tensor) -> Tensor | None:
    """A 4-D attention mask over ``[prefix; past; new]`` keys from one over ``[past; new]``: ``length``
    leading columns every query sees. No mask stays none unless the kernel would have inferred causality
    from its absence (sdpa's ``is_causal``), which a longer key sequence would misalign."""
    if mask is None:
        if not causal or queries == 1:
            return None
        rows = torch.arange(queries, device=like.device).unsqueeze(1) + past
        mask = (torch.arange(past + queries, device=like.device).unsqueeze(0) <= rows)[None, None]
        if eager:  # eager kernels add the mask to the scores
            mask = torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
                ~mask, torch.finfo(like.dtype).min)
    if not isinstance(mask, Tensor) or mask.dim() != 4:
        raise UserError("prefix tuning needs a 4-D attention mask (eager or sdpa attention), got "
                        f"{type(mask).__name__}")
    visible = torch.ones if mask.dtype == torch.bool else torch.zeros
    lead = visible(*mask.shape[:-1], length, dtype=mask.dtype, device=mask.device)
    return torch.cat([lead, mask], dim=-1)
