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

Nothing here knows a family: :mod:`fedlm.models.introspect` finds the embeddings, the block ModuleList,
the final norm and the rotary embedding on the loaded model. The bottom runs the base model's own
``forward`` and stops at the first server block (so embeddings, scaling and position handling are the
family's own code); the trunk and top call their blocks with the masks and rotary embeddings rebuilt on
each side from the 2-D padding mask and position ids with ``transformers.masking_utils``, per attention
kind (full, sliding window), so what crosses the boundary stays small and serialisable (see
:class:`Activations`). Encoder-decoders (t5, bart) are refused with one line: every decoder block
cross-attends to the encoder's output, so there is no single stack to cut.

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
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel
from transformers.masking_utils import (
    create_bidirectional_mask,
    create_bidirectional_sliding_window_mask,
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from fedlm.errors import UserError
from fedlm.models.heads import find_head
from fedlm.models.introspect import FULL, SLIDING, Layout, cache_argument, find_layout

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


# ------------------------------------------------------------------------------------------------ masks

_CAUSAL_MASKS: dict[str, Callable[..., object]] = {
    FULL: create_causal_mask,
    SLIDING: create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,
}
_CACHE_ARGUMENT = {kind: cache_argument(build) for kind, build in _CAUSAL_MASKS.items()}  # looked up once, not per call
_BIDIRECTIONAL_MASKS: dict[str, Callable[..., object]] = {
    FULL: create_bidirectional_mask,
    SLIDING: create_bidirectional_sliding_window_mask,
}


def _check_attention_kinds(layout: Layout, family: str) -> None:
    known = _CAUSAL_MASKS if layout.causal else _BIDIRECTIONAL_MASKS
    unknown = sorted(set(layout.layer_types) - set(known))
    if unknown:
        raise UserError(f"cannot cut a {family} model: its attention kind(s) {', '.join(unknown)} have no mask here")


# ------------------------------------------------------------------------------------------------ parts


class _Part(nn.Module):
    """Runs a slice of the model's blocks; builds their attention inputs from :class:`Activations`."""

    def __init__(self, model: PreTrainedModel, layout: Layout, blocks: list[nn.Module], first: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        base = model.base_model
        self.rotary = getattr(base, layout.rotary) if layout.rotary else None
        self._layout = layout
        self._types = layout.layer_types[first : first + len(blocks)]
        self._config = base.config
        self._takes_positions = bool(blocks) and "position_ids" in inspect.signature(blocks[0].forward).parameters

    def _run_blocks(self, acts: Activations) -> Activations:
        if not len(self.blocks):
            return acts
        hidden, position_ids = acts.hidden, acts.position_ids
        masks = {kind: self._mask(kind, hidden, acts.attention_mask, position_ids) for kind in set(self._types)}
        rotary = self._rotary(hidden, position_ids)
        for block, kind in zip(self.blocks, self._types, strict=True):
            extra = {}
            if self._takes_positions and position_ids is not None:
                extra["position_ids"] = position_ids
            if self.rotary is not None:
                extra["position_embeddings"] = rotary[kind] if self._layout.rotary_per_type else rotary
            out = block(hidden, attention_mask=masks[kind], **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return dataclasses.replace(acts, hidden=hidden)

    def _mask(self, kind: str, hidden: Tensor, mask_2d: Tensor | None, position_ids: Tensor | None) -> object:
        if self._layout.causal:
            no_cache = {_CACHE_ARGUMENT[kind]: None}  # a part's forward never generates: no cache
            return _CAUSAL_MASKS[kind](config=self._config, inputs_embeds=hidden, attention_mask=mask_2d,
                                       position_ids=position_ids, **no_cache)
        return _BIDIRECTIONAL_MASKS[kind](config=self._config, inputs_embeds=hidden, attention_mask=mask_2d)

    def _rotary(self, hidden: Tensor, position_ids: Tensor | None) -> object:
        if self.rotary is None:
            return None
        if self._layout.rotary_per_type:
            return {kind: self.rotary(hidden, position_ids, kind) for kind in set(self._types)}
        return self.rotary(hidden, position_ids)


class _Stop(Exception):
    """Raised at the first server block to end the base model's forward with that block's input."""

    def __init__(self, hidden: Tensor, kwargs: dict) -> None:
        super().__init__()
        self.hidden, self.kwargs = hidden, kwargs


class ClientBottom(_Part):
    """Client: embeddings plus the first k blocks, run by the base model's own ``forward`` up to block k."""

    def __init__(self, model: PreTrainedModel, layout: Layout, blocks: list[nn.Module], stop_at: nn.Module) -> None:
        super().__init__(model, layout, blocks, 0)
        base = model.base_model
        self.embeddings = nn.ModuleDict({name: getattr(base, name) for name in layout.embeddings})
        # plain tuples: the base model and the first server block are not the bottom's modules
        self._base: tuple[nn.Module, ...] = (base,)
        self._stop_at: tuple[nn.Module, ...] = (stop_at,)
        params = inspect.signature(base.forward).parameters
        self._takes_token_types = "token_type_ids" in params
        self._no_cache = {"use_cache": False} if "use_cache" in params else {}
        self._family = base.config.model_type

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Activations:
        """Token ids (+ padding mask, + BERT-style segment ids) -> what the trunk needs."""
        kwargs = dict(self._no_cache)
        if token_type_ids is not None:
            if not self._takes_token_types:
                raise ValueError(f"{self._family} models take no token_type_ids")
            kwargs["token_type_ids"] = token_type_ids
        hidden, block_kwargs = self._first_server_input(input_ids, attention_mask, kwargs)
        position_ids = block_kwargs.get("position_ids")
        if position_ids is None and self._layout.causal:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return Activations(hidden, attention_mask, position_ids)

    def _first_server_input(self, input_ids: Tensor, attention_mask: Tensor | None, kwargs: dict) -> tuple:
        owner = threading.get_ident()

        def stop(module: nn.Module, args: tuple, block_kwargs: dict) -> None:
            if threading.get_ident() == owner:  # another thread running the trunk passes through
                raise _Stop(args[0] if args else block_kwargs["hidden_states"], block_kwargs)

        handle = self._stop_at[0].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self._base[0](input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        except _Stop as reached:
            return reached.hidden, reached.kwargs
        finally:
            handle.remove()
        raise RuntimeError(f"the {self._family} forward never reached its first server block")


class ServerTrunk(_Part):
    """Server: the middle blocks. Sees hidden states and masks only."""

    def forward(self, acts: Activations) -> Activations:
        return self._run_blocks(acts)


class ClientTop(_Part):
    """Client: the last m blocks, the final norm, and every head module (pooler, classifier, LM head)."""

    def __init__(
        self, model: PreTrainedModel, layout: Layout, blocks: list[nn.Module], first: int,
        head: dict[str, nn.Module],
    ) -> None:
        super().__init__(model, layout, blocks, first)
        self.head = nn.ModuleDict(head)
        self._task_class = type(model).__name__
        self._head_fn = find_head(model)

    def forward(self, acts: Activations) -> Tensor:
        """-> the base model's ``last_hidden_state`` (what the task's head modules take)."""
        hidden = self._run_blocks(acts).hidden
        for name in self._layout.final_norm:
            hidden = self.head[name](hidden)
        return hidden

    def logits(self, hidden: Tensor, input_ids: Tensor | None = None) -> Tensor:
        """The task model's ``logits`` from ``forward``'s output; decoder classifiers also need ``input_ids``."""
        if self._head_fn is None:
            raise UserError(f"split training has no head for {self._task_class}")
        return self._head_fn(self.head, hidden, input_ids, self._config)


class SplitModel:
    """A model cut into ``bottom`` and ``top`` (client) and ``trunk`` (server), sharing its modules."""

    def __init__(self, model: PreTrainedModel, cut: Cut) -> None:
        family = model.config.model_type
        layout = find_layout(model)
        _check_attention_kinds(layout, family)
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
        self.layout = layout
        self.bottom = ClientBottom(model, layout, blocks[:k], stop_at=blocks[k])
        self.trunk = ServerTrunk(model, layout, blocks[k : n - m], k)
        self.top = ClientTop(model, layout, blocks[n - m :], n - m, _top_head_modules(model, layout))
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


def _top_head_modules(model: PreTrainedModel, layout: Layout) -> dict[str, nn.Module]:
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
