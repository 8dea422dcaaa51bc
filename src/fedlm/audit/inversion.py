"""Activation inversion (FL-GLM section 4.3.3, after Pasquini et al.'s FSHA): a server that sees the hidden
states crossing the split boundary trains a model that maps them back to token ids, on public text it passes
through a client bottom it knows, then reads the clients' real activations with it.

The inverter is a small network over the boundary width: a per-position MLP (enough when the boundary is
the embedding layer, where each position's vector is a lookup of its own token) or a one-layer transformer
encoder (FL-GLM's attack model, which can also undo the mixing of a client-side block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from fedlm.errors import UserError

Kind = Literal["mlp", "transformer"]


@dataclass(frozen=True)
class BoundarySet:
    """Boundary activations with the token ids they came from: ``hidden`` (n, seq, width), ``ids`` (n, seq),
    ``mask`` (n, seq) true where a real token (not padding) sits."""

    hidden: Tensor
    ids: Tensor
    mask: Tensor

    def __len__(self) -> int:
        return self.hidden.shape[0]


class Inverter(nn.Module):
    """Boundary hidden states -> logits over ``classes`` (the token ids the public text holds: an inverter
    can only learn tokens it has seen, and a vocabulary-wide output layer would cost the most of it)."""

    def __init__(self, width: int, classes: Tensor, kind: Kind = "transformer", inner: int = 128,
                 heads: int = 4) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("classes", classes)
        self.norm = nn.LayerNorm(width)  # boundary scales differ by family and cut; the attacker normalises
        self.project = nn.Linear(width, inner)
        if kind == "transformer":
            self.mix: nn.Module = nn.TransformerEncoderLayer(inner, heads, dim_feedforward=2 * inner, dropout=0.0,
                                                             batch_first=True)
        elif kind == "mlp":
            self.mix = nn.Sequential(nn.GELU(), nn.Linear(inner, inner))
        else:
            raise UserError(f"inverter kind {kind!r} is not one of mlp, transformer")
        self.out = nn.Linear(inner, len(classes))

    def forward(self, hidden: Tensor, mask: Tensor) -> Tensor:
        x = self.project(self.norm(hidden))
        x = self.mix(x, src_key_padding_mask=~mask) if self.kind == "transformer" else x + self.mix(x)
        return self.out(x)


def train_inverter(public: BoundarySet, *, kind: Kind = "transformer", steps: int = 300, batch_size: int = 32,
                   lr: float = 3e-3, seed: int = 0) -> Inverter:
    """Fit an :class:`Inverter` on public activations (cross-entropy on real-token positions)."""
    if len(public) == 0 or not bool(public.mask.any()):
        raise UserError("the attacker's public text gave no sequences to train the inversion model on; give a "
                        "file with text lines (--public-text)")
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    classes = torch.unique(public.ids[public.mask])
    index = torch.searchsorted(classes, public.ids.clamp(max=int(classes[-1])))  # id -> class (real positions)
    model = Inverter(public.hidden.shape[-1], classes, kind)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(public), (min(batch_size, len(public)),), generator=generator)
        mask = public.mask[pick]
        logits = model(public.hidden[pick], mask)
        loss = loss_fn(logits[mask], index[pick][mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def invert(model: Inverter, target: BoundarySet, batch_size: int = 64) -> Tensor:
    """The attacker's guess of every position's token id, (n, seq)."""
    guesses = [model.classes[model(target.hidden[i : i + batch_size], target.mask[i : i + batch_size]).argmax(-1)]
               for i in range(0, len(target), batch_size)]
    return torch.cat(guesses) if guesses else target.ids.clone()
