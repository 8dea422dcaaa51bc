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
:class:`Activations`). What else a family's blocks take is rebuilt the same way where the family's own code
can be asked for it: an encoder that builds its blocks' attention inputs itself (DeBERTa's
``get_attention_mask``, ``get_rel_pos``, ``get_rel_embedding``) is asked; Falcon's ``alibi`` is ``None`` when its
config uses rotary embeddings. Encoder-decoders (t5, bart) are refused with one line: every decoder block
cross-attends to the encoder's output, so there is no single stack to cut; so is any family whose blocks
need what a part cannot rebuild (ALiBi folded into the mask, modules run between blocks), and
:meth:`SplitModel.check_exact` refuses, before training, a model whose split forward is not its own.

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
from collections.abc import Callable, Mapping
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
from fedlm.models.heads import find_head, pools_outside_forward, task_logits
from fedlm.models.introspect import FULL, SLIDING, Layout, cache_argument, find_layout, self_attributes

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
    position_ids: Tensor | None = None  # (1 or batch, seq); decoders only (causal mask, rotary embeddings);
    # an encoder's rotary embedding (ModernBERT) numbers its tokens 0..n-1 on each side

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
        takes = inspect.signature(blocks[0].forward).parameters if blocks else {}
        self._takes_positions = "position_ids" in takes
        self._no_alibi = {"alibi": None} if "alibi" in takes else {}  # ALiBi on is refused (_check_block_inputs)
        # a plain tuple: the container (the base model, OPT's decoder, DeBERTa's encoder) is not the part's module
        self._container: tuple[nn.Module, ...] = (base.get_submodule(layout.container) if layout.container else base,)
        self._own_inputs = _builds_own_inputs(self._container[0], takes)

    def _run_blocks(self, acts: Activations) -> Activations:
        if not len(self.blocks):
            return acts
        hidden, position_ids = acts.hidden, acts.position_ids
        if self._own_inputs:
            masks, shared = self._container_inputs(hidden, acts.attention_mask)
        else:
            masks = {kind: self._mask(kind, hidden, acts.attention_mask, position_ids) for kind in set(self._types)}
            shared = dict(self._no_alibi)
        rotary = self._rotary(hidden, position_ids)
        for block, kind in zip(self.blocks, self._types, strict=True):
            extra = dict(shared)
            if self._takes_positions and position_ids is not None:
                extra["position_ids"] = position_ids
            if self.rotary is not None:
                extra["position_embeddings"] = rotary[kind] if self._layout.rotary_per_type else rotary
            out = block(hidden, attention_mask=masks[kind], **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return dataclasses.replace(acts, hidden=hidden)

    def _container_inputs(self, hidden: Tensor, mask_2d: Tensor | None) -> tuple[dict[str, object], dict]:
        """The attention mask and relative positions as the blocks' container builds them (DeBERTa: a 0/1
        mask over query and key, never None; relative positions and their embeddings, shared by all blocks)."""
        container = self._container[0]
        if mask_2d is None:  # the base model's own default: every token visible
            mask_2d = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        mask = container.get_attention_mask(mask_2d)
        return ({kind: mask for kind in set(self._types)},
                {"relative_pos": container.get_rel_pos(hidden), "rel_embeddings": container.get_rel_embedding()})

    def _mask(self, kind: str, hidden: Tensor, mask_2d: Tensor | None, position_ids: Tensor | None) -> object:
        if self._layout.causal:
            no_cache = {_CACHE_ARGUMENT[kind]: None}  # a part's forward never generates: no cache
            return _CAUSAL_MASKS[kind](config=self._config, inputs_embeds=hidden, attention_mask=mask_2d,
                                       position_ids=position_ids, **no_cache)
        return _BIDIRECTIONAL_MASKS[kind](config=self._config, inputs_embeds=hidden, attention_mask=mask_2d)

    def _rotary(self, hidden: Tensor, position_ids: Tensor | None) -> object:
        if self.rotary is None:
            return None
        if position_ids is None:  # an encoder's rotary embedding (ModernBERT): tokens 0..n-1, as its model numbers them
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
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
        self.embeddings = nn.ModuleList([base.get_submodule(path) for path in layout.embeddings])
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
        elif position_ids is not None:
            # OPT numbers padding -1 (its position embeddings, already added here, skip it); the trunk refuses
            # negative positions, and a masked pad's position is never seen
            position_ids = position_ids.clamp(min=0)
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
    """Server: the middle blocks, and what its blocks alone read besides their own weights (DeBERTa's relative
    position embeddings, when the client keeps no block). Sees hidden states and masks only."""

    def __init__(self, model: PreTrainedModel, layout: Layout, blocks: list[nn.Module], first: int) -> None:
        super().__init__(model, layout, blocks, first)
        self.shared = nn.ModuleList([model.base_model.get_submodule(path) for path in layout.shared])

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
        self.final = nn.ModuleList([model.base_model.get_submodule(path) for path in layout.final_norm])
        self._task_class = type(model).__name__
        self._head_fn = find_head(model)

    def forward(self, acts: Activations) -> Tensor:
        """-> the base model's ``last_hidden_state`` (what the task's head modules take)."""
        hidden = self._run_blocks(acts).hidden
        for module in self.final:  # a final norm (OPT: then its projection out)
            hidden = module(hidden)
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
        _check_block_inputs(model, layout, blocks[0], cut)
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

    def check_exact(self, atol: float | None = None) -> None:
        """Refuse, in one line, a model whose split forward is not its own: the bottom, trunk and top run on a
        small batch with and without padding (in eval mode, without gradients) must give the base model's last
        hidden state at every real token, and the top's head the task model's logits. Catches, before training,
        whatever in a family the parts do not rebuild; ``atol`` (relative to the values' scale) defaults to
        1e-4 in float32, 5e-2 in 16 bits."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for padded in (True, False):
                    ids, mask = self._probe(padded)
                    where = f"on a batch {'with' if padded else 'without'} padding"
                    hidden = self._run_split(self._hidden, ids, mask)
                    out = self.model.base_model(input_ids=ids, attention_mask=mask, **self.bottom._no_cache)
                    want = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                    real = mask.bool()
                    self._compare("forward", hidden[real], want[real], where, atol)
                    expected = self._model_logits(ids, mask, want)
                    if expected is not None:
                        logits = self._run_split(self.top.logits, hidden, ids)
                        pick = real if expected.dim() == 3 else slice(None)
                        self._compare("task head", logits[pick], expected[pick], where, atol)
        finally:
            self.model.train(was_training)

    def _hidden(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.top(self.trunk(self.bottom(ids, mask)))

    def _run_split(self, step: Callable[..., Tensor], *args: Tensor) -> Tensor:
        try:
            return step(*args)
        except UserError:
            raise
        except Exception as exc:  # a model-support error: no retry can fix it, so it stops the run at once
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            raise UserError(f"cannot split a {self.model.config.model_type} model: it fails when run by split "
                            f"parts ({reason}); {_INSTEAD}") from exc

    def _model_logits(self, ids: Tensor, mask: Tensor, hidden: Tensor) -> Tensor | None:
        """The task model's own logits on the probe (from its unsplit last ``hidden`` state where fedlm's head
        mean-pools and the family's forward would not); None where the top has no head or the model
        cannot run it (a decoder classifier without a pad token): nothing to compare."""
        if self.top._head_fn is None:
            return None
        if pools_outside_forward(self.model):
            return task_logits(self.model, hidden, ids)
        try:
            logits = getattr(self.model(input_ids=ids, attention_mask=mask, **self.bottom._no_cache), "logits", None)
        except Exception:  # the unsplit model's own limits (no pad token, ...) are not the split's to judge
            return None
        return logits if isinstance(logits, Tensor) else None

    def _compare(self, what: str, got: Tensor, want: Tensor, where: str, atol: float | None) -> None:
        family = self.model.config.model_type
        if got.shape != want.shape:
            raise UserError(f"cannot split a {family} model: its split {what} gives shape {tuple(got.shape)} where "
                            f"the unsplit model gives {tuple(want.shape)}; {_INSTEAD}")
        diff = (got.float() - want.float()).abs().max().item()
        scale = max(1.0, want.float().abs().max().item())
        tolerance = atol if atol is not None else (1e-4 if want.dtype == torch.float32 else 5e-2)
        if not diff <= tolerance * scale:  # also refuses NaN
            raise UserError(f"cannot split a {family} model exactly: its split {what} differs from the unsplit "
                            f"model's by {diff:.1e} {where}, so split training would not train this model; "
                            f"{_INSTEAD}")

    def _probe(self, padded: bool) -> tuple[Tensor, Tensor]:
        """Two rows of 6 token ids (no pad id among them) and their mask: the second row's last two tokens
        are padding (its first two for a decoder, which pads on the left) when ``padded``."""
        config = self.model.config
        device = next(self.model.parameters()).device
        vocab = self.model.get_input_embeddings().num_embeddings
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        ids = (torch.arange(12, device=device).view(2, 6) * 7 + 3) % vocab
        ids = ids.masked_fill(ids == pad, (pad + 1) % vocab)
        mask = torch.ones_like(ids)
        if padded:
            mask[1, slice(0, 2) if self.layout.causal else slice(4, 6)] = 0
            ids = ids.masked_fill(mask == 0, pad)
        return ids, mask

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


_INSTEAD = ("train it without a split section (fedavg, with or without an adapter), or split a family the README's "
            "family table lists as exact")
_SUPPLIED = {"attention_mask", "position_ids", "position_embeddings", "alibi"}


def _builds_own_inputs(container: nn.Module, takes: Mapping[str, inspect.Parameter]) -> bool:
    """Whether the blocks' container builds their attention inputs itself (DeBERTa's encoder: its own mask
    convention and relative positions), so a part asks it rather than ``masking_utils``."""
    return all(callable(getattr(container, name, None))
               for name in ("get_attention_mask", "get_rel_pos", "get_rel_embedding")) and "rel_embeddings" in takes


def _check_block_inputs(model: PreTrainedModel, layout: Layout, block: nn.Module, cut: Cut) -> None:
    """Refuse, in one line naming the family, a model whose blocks need what a split part cannot give them."""
    family = model.config.model_type
    takes = inspect.signature(block.forward).parameters
    container = model.base_model.get_submodule(layout.container) if layout.container else model.base_model
    own = _builds_own_inputs(container, takes)
    if "alibi" in takes and getattr(model.config, "alibi", True):
        raise UserError(f"cannot split a {family} model with ALiBi position biases: its model's forward folds them "
                        "into the attention mask, which a split part does not rebuild; use rotary embeddings "
                        f"(falcon: alibi false) or {_INSTEAD}")
    needed = [name for name, p in list(takes.items())[1:] if p.default is inspect.Parameter.empty
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name not in _SUPPLIED]
    if needed:
        raise UserError(f"cannot split a {family} model: its blocks need {', '.join(needed)}, which a split part "
                        f"does not rebuild; {_INSTEAD}")
    params = {path for path in layout.shared if any(True for _ in model.base_model.get_submodule(path).parameters())}
    used = self_attributes(type(container).get_rel_embedding) if own else set()  # what the parts run of them
    read = {f"{layout.container}.{name}" for name in used}
    unrun = sorted(params - read)
    if unrun:
        raise UserError(f"cannot split a {family} model: its {layout.container} runs {', '.join(unrun)} between "
                        f"its blocks, which a split part does not run; {_INSTEAD}")
    if params and (cut.bottom_blocks or cut.top_blocks):
        raise UserError(f"cannot split a {family} model with client blocks: every block reads "
                        f"{', '.join(sorted(params))} (relative position embeddings), which must stay on one side; "
                        "use split.bottom_blocks 0 and split.top_blocks 0 (the server holds every block)")


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
