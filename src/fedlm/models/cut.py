"""Cut a Hugging Face model into client bottom, server trunk and client top for federated split learning.

FedBERT keeps the embeddings and the task head on the client and runs every transformer block on the
server (``Cut(0, 0)``); FL-GLM also keeps the first and last block on the client (``Cut(1, 1)``). Both are
one :class:`Cut`; no code path depends on which.

Why the parts *reference* the model's own modules instead of copying or re-implementing them:

* exactness: each block, embedding, norm and head runs the installed ``transformers`` code (attention
  kernels, rotary embeddings, mask conventions), so a split step computes the same loss and gradients as
  the unsplit model, and evaluation can use the plain model;
* one set of weights: an optimizer step on a part updates the model in place, so the trained model still
  saves with ``save_pretrained`` and loads back whole with plain ``transformers``, and tied weights
  (word embeddings = MLM decoder / LM head) stay one tensor, owned by the client.

Only the glue between modules is written here: the few lines of each base model's ``forward`` that add
position embeddings and build the attention mask, taken from the family's modeling code. The 4-D mask is
rebuilt on each side from the 2-D padding mask with the model's own masking utilities, so what crosses
the boundary stays small and serialisable (see :class:`Activations`).

Protocol of one training step (each ``detached()`` stands for a network hop)::

    sent = split.bottom(input_ids, attention_mask)        # client
    received = sent.detached()
    out = split.trunk(received)                            # server
    top_in = out.detached()
    hidden = split.top(top_in)                             # client: last hidden state
    loss = loss_fn(split.top.logits(hidden, input_ids))    # client (or the task's own head on ``hidden``)
    loss.backward()                                        # client: grads of top + top_in.hidden.grad
    out.hidden.backward(top_in.hidden.grad)                # server: grads of trunk + received.hidden.grad
    sent.hidden.backward(received.hidden.grad)             # client: grads of bottom
    # then the client steps on split.client_parameters(), the server on split.trunk_parameters()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

from fedlm.errors import UserError
from fedlm.models.heads import HEADS

__all__ = ["Activations", "ClientBottom", "ClientTop", "Cut", "ServerTrunk", "SplitModel"]


@dataclass(frozen=True)
class Cut:
    """Where to cut: ``bottom_blocks`` blocks stay with the embeddings, ``top_blocks`` with the head."""

    bottom_blocks: int = 0
    top_blocks: int = 0


@dataclass(frozen=True, eq=False)  # eq=False: tensors have no truth value to compare by
class Activations:
    """What crosses the client/server boundary in the forward direction; its gradient is ``hidden.grad``.

    Never token ids or labels: only hidden states plus what attention needs to treat them as the unsplit
    model would. The trunk hands back the same mask and positions it received; a transport may send back
    only ``hidden`` and let the client reattach its own (``dataclasses.replace(sent, hidden=...)``).
    """

    hidden: Tensor  # (batch, seq, width)
    attention_mask: Tensor | None = None  # (batch, seq) 2-D padding mask, 1 = token, 0 = padding; None = no padding
    position_ids: Tensor | None = None  # (1 or batch, seq); decoders only (causal mask, rotary embeddings)

    def detached(self) -> Activations:
        """The copy the receiver works on: ``hidden`` cut from the sender's graph, as a leaf needing grad."""
        return dataclasses.replace(self, hidden=self.hidden.detach().requires_grad_(True))

    def to_dict(self) -> dict[str, Tensor]:
        """The non-empty fields, for a transport to serialise."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    @classmethod
    def from_dict(cls, tensors: dict[str, Tensor]) -> Activations:
        return cls(**tensors)


# ---------------------------------------------------------------------------------------------- layouts

Modules = nn.ModuleDict
EmbedFn = Callable[[Modules, Tensor, Tensor | None], tuple[Tensor, Tensor | None]]


def _embed_bert(modules: Modules, input_ids: Tensor, token_type_ids: Tensor | None) -> tuple[Tensor, None]:
    # bert and roberta: the embeddings module derives positions itself (roberta: padding-aware, from ids)
    return modules["embeddings"](input_ids=input_ids, token_type_ids=token_type_ids), None


def _embed_distilbert(modules: Modules, input_ids: Tensor, token_type_ids: Tensor | None) -> tuple[Tensor, None]:
    _no_token_types("distilbert", token_type_ids)
    return modules["embeddings"](input_ids), None


def _embed_gpt2(modules: Modules, input_ids: Tensor, token_type_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    # GPT2Model.forward without a cache
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    hidden = modules["wte"](input_ids) + modules["wpe"](position_ids)
    if token_type_ids is not None:
        hidden = hidden + modules["wte"](token_type_ids)
    return modules["drop"](hidden), position_ids


def _embed_llama(modules: Modules, input_ids: Tensor, token_type_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    # LlamaModel.forward without a cache
    _no_token_types("llama", token_type_ids)
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    return modules["embed_tokens"](input_ids), position_ids


def _no_token_types(family: str, token_type_ids: Tensor | None) -> None:
    if token_type_ids is not None:
        raise ValueError(f"{family} models take no token_type_ids")


@dataclass(frozen=True)
class _Layout:
    """Where one family keeps its parts, as attribute names on the base model (``model.base_model``)."""

    embeddings: tuple[str, ...]  # modules before block 0 (client bottom)
    blocks: str  # dotted path of the nn.ModuleList of transformer blocks
    embed: EmbedFn  # input ids -> (block-0 input, position ids that cross the boundary)
    final_norm: str | None = None  # applied after the last block (client top)
    rotary: str | None = None  # parameter-free rotary embedding, recomputed by each part from position ids
    causal: bool = False


_BERT_LAYOUT = _Layout(embeddings=("embeddings",), blocks="encoder.layer", embed=_embed_bert)
LAYOUTS: dict[str, _Layout] = {
    "bert": _BERT_LAYOUT,
    "roberta": _BERT_LAYOUT,
    "distilbert": _Layout(embeddings=("embeddings",), blocks="transformer.layer", embed=_embed_distilbert),
    "gpt2": _Layout(embeddings=("wte", "wpe", "drop"), blocks="h", embed=_embed_gpt2, final_norm="ln_f", causal=True),
    "llama": _Layout(
        embeddings=("embed_tokens",),
        blocks="layers",
        embed=_embed_llama,
        final_norm="norm",
        rotary="rotary_emb",
        causal=True,
    ),
}


# ------------------------------------------------------------------------------------------------ parts


class _Part(nn.Module):
    """Runs a slice of the model's blocks; builds their attention inputs from :class:`Activations`."""

    def __init__(self, model: PreTrainedModel, layout: _Layout, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        base = model.base_model
        self.rotary = getattr(base, layout.rotary) if layout.rotary else None
        self._causal = layout.causal or bool(getattr(base.config, "is_decoder", False))
        self._config = base.config

    def _run_blocks(self, acts: Activations) -> Activations:
        if not len(self.blocks):
            return acts
        hidden, mask_2d, position_ids = acts.hidden, acts.attention_mask, acts.position_ids
        if self._causal:
            mask = create_causal_mask(
                config=self._config,
                inputs_embeds=hidden,
                attention_mask=mask_2d,
                past_key_values=None,
                position_ids=position_ids,
            )
        else:
            mask = create_bidirectional_mask(config=self._config, inputs_embeds=hidden, attention_mask=mask_2d)
        extra = {}
        if position_ids is not None:
            extra["position_ids"] = position_ids
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(hidden, position_ids=position_ids)
        for block in self.blocks:
            hidden = block(hidden, attention_mask=mask, **extra)
        return dataclasses.replace(acts, hidden=hidden)


class ClientBottom(_Part):
    """Client: embeddings plus the first k blocks."""

    def __init__(self, model: PreTrainedModel, layout: _Layout, blocks: list[nn.Module]) -> None:
        super().__init__(model, layout, blocks)
        self.embeddings = nn.ModuleDict({name: getattr(model.base_model, name) for name in layout.embeddings})
        self._embed = layout.embed

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Activations:
        """Token ids (+ padding mask, + BERT-style segment ids) -> what the trunk needs."""
        hidden, position_ids = self._embed(self.embeddings, input_ids, token_type_ids)
        return self._run_blocks(Activations(hidden, attention_mask, position_ids))


class ServerTrunk(_Part):
    """Server: the middle blocks. Sees hidden states and masks only."""

    def forward(self, acts: Activations) -> Activations:
        return self._run_blocks(acts)


class ClientTop(_Part):
    """Client: the last m blocks, the final norm, and every head module (pooler, classifier, LM head)."""

    def __init__(
        self, model: PreTrainedModel, layout: _Layout, blocks: list[nn.Module], head: dict[str, nn.Module]
    ) -> None:
        super().__init__(model, layout, blocks)
        self.head = nn.ModuleDict(head)
        self._final_norm = layout.final_norm
        self._task_class = type(model).__name__
        self._head_fn = HEADS.get(self._task_class)

    def forward(self, acts: Activations) -> Tensor:
        """-> the base model's ``last_hidden_state`` (what the task's head modules take)."""
        hidden = self._run_blocks(acts).hidden
        return self.head[self._final_norm](hidden) if self._final_norm else hidden

    def logits(self, hidden: Tensor, input_ids: Tensor | None = None) -> Tensor:
        """The task model's ``logits`` from ``forward``'s output; decoder classifiers also need ``input_ids``."""
        if self._head_fn is None:
            raise UserError(f"split training has no head for {self._task_class}")
        return self._head_fn(self.head, hidden, input_ids, self._config)


class SplitModel:
    """A model cut into ``bottom`` and ``top`` (client) and ``trunk`` (server), sharing its modules."""

    def __init__(self, model: PreTrainedModel, cut: Cut) -> None:
        family = model.config.model_type
        if family not in LAYOUTS:
            raise UserError(f"split learning supports {', '.join(LAYOUTS)} models, not {family!r}")
        layout = LAYOUTS[family]
        base = model.base_model
        blocks = list(base.get_submodule(layout.blocks))
        k, m, n = cut.bottom_blocks, cut.top_blocks, len(blocks)
        if not (isinstance(k, int) and isinstance(m, int)) or k < 0 or m < 0 or k + m >= n:
            raise UserError(
                f"cannot cut a {n}-block {family} model into {k} bottom + {m} top client blocks: "
                f"the server trunk needs at least one block (bottom_blocks + top_blocks < {n}, both >= 0)"
            )
        self.model = model
        self.cut = cut
        self.bottom = ClientBottom(model, layout, blocks[:k])
        self.trunk = ServerTrunk(model, layout, blocks[k : n - m])
        self.top = ClientTop(model, layout, blocks[n - m :], _top_head_modules(model, layout))
        self._check_ownership()

    def client_parameters(self) -> list[nn.Parameter]:
        """Bottom and top parameters, each once (tied weights included once): the client's optimizer."""
        return _unique([*self.bottom.parameters(), *self.top.parameters()])

    def trunk_parameters(self) -> list[nn.Parameter]:
        """The server's parameters: the middle blocks only."""
        return list(self.trunk.parameters())

    def bottom_parameter_names(self) -> list[str]:
        """Names of the bottom's parameters (embeddings and first blocks; tied output weights included)."""
        return self._names(list(self.bottom.parameters()))

    def client_parameter_names(self) -> list[str]:
        """Names, as in ``model.named_parameters()``, of ``client_parameters``."""
        return self._names(self.client_parameters())

    def trunk_parameter_names(self) -> list[str]:
        """Names, as in ``model.named_parameters()``, of ``trunk_parameters``."""
        return self._names(self.trunk_parameters())

    def logits(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """All three parts in one process, no boundary: the task model's logits (for evaluation)."""
        hidden = self.top(self.trunk(self.bottom(input_ids, attention_mask, token_type_ids)))
        return self.top.logits(hidden, input_ids)

    def _names(self, params: list[nn.Parameter]) -> list[str]:
        wanted = {id(p) for p in params}
        return [name for name, p in self.model.named_parameters() if id(p) in wanted]

    def _check_ownership(self) -> None:
        client = {id(p) for p in self.client_parameters()}
        trunk = {id(p) for p in self.trunk_parameters()}
        everything = {id(p) for p in self.model.parameters()}
        shared = self._names([p for p in self.trunk_parameters() if id(p) in client])
        missing = [name for name, p in self.model.named_parameters() if id(p) not in client | trunk]
        if shared or missing or (client | trunk) != everything:
            raise UserError(
                f"cannot split this {type(self.model).__name__}: parameters shared by client and server "
                f"{shared or 'none'}, owned by neither {missing or 'none'}"
            )


def _top_head_modules(model: PreTrainedModel, layout: _Layout) -> dict[str, nn.Module]:
    """Everything that is neither embeddings nor blocks: base-model leftovers (final norm, pooler) and the
    task model's own head children, by attribute name."""
    base = model.base_model
    skip = {*layout.embeddings, layout.blocks.split(".")[0], layout.rotary}
    modules = {name: child for name, child in base.named_children() if name not in skip}
    if model is not base:
        for name, child in model.named_children():
            if child is base:
                continue
            if name in modules:
                raise UserError(f"cannot split {type(model).__name__}: head module name {name!r} is ambiguous")
            modules[name] = child
    return modules


def _unique(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list(dict.fromkeys(params))  # tensors hash by identity
