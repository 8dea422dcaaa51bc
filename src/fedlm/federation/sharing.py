"""Which parameters travel: each trainable parameter is global (sent, aggregated), local (trained, kept by its
client, never sent) or frozen (not trained, no gradient, not sent), per client and per round.

Parameters are picked by selectors that mean the same in every family because each parameter's group is
found on the loaded model (``fedlm.models.introspect.parameter_groups``: its block ModuleList, its input
embeddings), not by per-architecture attribute paths; without a model, ``layer_of`` guesses from the name:

* ``embeddings``: token/position/type embeddings and what runs before the first block;
* ``head``: everything after the last block (pooler, classifier, LM head, final norm);
* ``block N`` / ``blocks A-B``: transformer blocks, counted from 1 as the papers do; an encoder-decoder's
  blocks are counted encoder first, then decoder (t5 with 2 + 2 blocks: blocks 1-2 encoder, 3-4 decoder);
* ``re:PATTERN``: a regular expression searched in the parameter name.

FedSplitBERT's critical layer c makes the embeddings and blocks 1..c global and the rest local (c = 0:
isolated training, c = L: FedAvg). FFDAPT freezes a rotating window of blocks on each client.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fedlm.config import SharingConfig
from fedlm.config.protocol_kinds import ProtocolKind
from fedlm.errors import UserError

_BLOCK = re.compile(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)(?:\w*embed\w*|wte|wpe)\.")
_RANGE = re.compile(r"^blocks?\s+(\d+)(?:\s*-\s*(\d+))?$")

EMBEDDINGS = "embeddings"
HEAD = "head"

Groups = Mapping[str, str | int]  # parameter name -> 0-based block index, 'embeddings' or 'head'


def layer_of(name: str) -> str | int:
    """The 0-based block index of a parameter, or 'embeddings', or 'head' (anything outside the blocks),
    guessed from the name alone (common HF attribute names); prefer the model's ``parameter_groups``."""
    match = _BLOCK.search(name)
    if match:
        return int(match.group(1))
    return EMBEDDINGS if _EMBEDDING.search(name) else HEAD


def _group(name: str, groups: Groups | None) -> str | int:
    return groups[name] if groups is not None and name in groups else layer_of(name)


def num_blocks(names: Iterable[str], groups: Groups | None = None) -> int:
    indices = [g for g in (_group(n, groups) for n in names) if isinstance(g, int)]
    return max(indices) + 1 if indices else 0


def select(selector: str, names: Sequence[str], where: str, groups: Groups | None = None) -> list[str]:
    """The names a selector picks, in model order; a selector that picks nothing is a config mistake."""
    text = selector.strip()
    if text.startswith("re:"):
        try:
            pattern = re.compile(text[3:])
        except re.error as exc:
            raise UserError(f"{where}: {selector!r} is not a valid regular expression ({exc})") from None
        picked = [n for n in names if pattern.search(n)]
    elif text in (EMBEDDINGS, HEAD):
        picked = [n for n in names if _group(n, groups) == text]
    else:
        match = _RANGE.match(text)
        if not match:
            raise UserError(f"{where}: unknown selector {selector!r} (use embeddings, head, 'block N', "
                            "'blocks A-B' counted from 1, or 're:PATTERN')")
        first = int(match.group(1))
        last = int(match.group(2) or first)
        blocks = set(range(first - 1, last))
        picked = [n for n in names if _group(n, groups) in blocks]
    if not picked:
        raise UserError(f"{where}: selector {selector!r} matches no trainable parameter of this model "
                        f"({num_blocks(names, groups)} blocks)")
    return picked


@dataclass(frozen=True)
class FreezeWindow:
    """FFDAPT (FDAPT Algorithm 1): client k freezes N_k = min(epsilon, ceil(n_k / n * N) * gamma) consecutive
    blocks, the window starting where the previous client's ended and wrapping around the N blocks.

    The window start is a pure function of (round, position among the round's clients) so that resumed runs
    and deployed clients agree: each round advances it by the whole population's sum of N_k, which is exactly
    the algorithm when every client takes part each round (as in FDAPT); the paper's ``end = start + N_k``
    freezes N_k + 1 blocks, here a window holds exactly N_k.
    """

    epsilon: int
    gamma: float
    blocks: int
    sizes: dict[int, int]

    def count(self, client_id: int) -> int:
        total = sum(self.sizes.values())
        share = self.sizes.get(client_id, 0) / total if total else 0.0
        return max(0, min(self.epsilon, int(math.ceil(share * self.blocks) * self.gamma), self.blocks - 1))

    def frozen_blocks(self, round_idx: int, clients: Sequence[int], client_id: int) -> list[int]:
        """0-based indices of the blocks ``client_id`` freezes in this round."""
        if self.blocks == 0:
            return []
        per_round = sum(self.count(c) for c in self.sizes)
        start = (round_idx - 1) * per_round
        for other in clients:
            if other == client_id:
                break
            start += self.count(other)
        return [(start + i) % self.blocks for i in range(self.count(client_id))]


@dataclass(frozen=True)
class SharingPolicy:
    """The resolved assignment for one run: global and local names, names frozen for everyone, and an
    optional FFDAPT window that freezes some global blocks per client and round."""

    global_names: list[str]
    local_names: list[str]
    frozen_names: list[str] = field(default_factory=list)
    window: FreezeWindow | None = None
    groups: Groups | None = None  # the model's parameter groups; None: guessed from names (``layer_of``)

    @property
    def personalized(self) -> bool:
        """Clients end with models of their own (some parameters never leave them)."""
        return bool(self.local_names)

    def frozen_for(self, round_idx: int, clients: Sequence[int], client_id: int) -> tuple[str, ...]:
        """Parameters this client does not train (nor upload) in this round, beyond those frozen for all."""
        if self.window is None:
            return ()
        blocks = set(self.window.frozen_blocks(round_idx, clients, client_id))
        return tuple(n for n in self.global_names + self.local_names if self.group(n) in blocks)

    def group(self, name: str) -> str | int:
        """The parameter's block index, 'embeddings' or 'head'."""
        return _group(name, self.groups)


def build_policy(sharing: SharingConfig, protocol: ProtocolKind, names: Sequence[str],
                 client_sizes: dict[int, int], groups: Groups | None = None) -> SharingPolicy:
    """Resolve the config's ``sharing`` section against the model's trainable parameter names and, when
    given, its parameter groups (``fedlm.models.introspect.parameter_groups``)."""
    blocks = num_blocks(names, groups)
    frozen: list[str] = []
    for selector in sharing.frozen:
        frozen.extend(n for n in select(selector, names, "sharing.frozen", groups) if n not in frozen)
    trainable = [n for n in names if n not in frozen]
    critical = sharing.critical_layer
    if critical is not None and not 0 <= critical <= blocks:
        raise UserError(f"sharing.critical_layer = {critical}: this model has {blocks} blocks (use 0..{blocks})")
    if protocol.shares_nothing:
        if critical not in (None, 0):
            raise UserError(f"sharing.critical_layer conflicts with protocol.kind = {protocol.name} ({protocol.name} "
                            "is c = 0)")
        critical = 0
    if protocol.pools_data or critical is None or critical == blocks:
        global_names = list(trainable)
    elif critical == 0:
        global_names = []
    else:
        shared_groups = {EMBEDDINGS, *range(critical)}
        global_names = [n for n in trainable if _group(n, groups) in shared_groups]
    for selector in sharing.local:
        picked = set(select(selector, names, "sharing.local", groups))
        global_names = [n for n in global_names if n not in picked]
    local_names = [n for n in trainable if n not in global_names]
    window = None
    spec = sharing.freeze_window
    if spec is not None and not protocol.pools_data:
        window = FreezeWindow(spec.epsilon, spec.gamma, blocks, dict(client_sizes))
    return SharingPolicy(global_names, local_names, frozen, window, groups)
