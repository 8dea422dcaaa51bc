"""What crosses the split boundary, recomputed: a client bottom's activations for public text (the
attacker's training set) and for a client's real training batches (the attack's target), in the precision
the wire carries them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from fedlm.audit.inversion import BoundarySet
from fedlm.errors import UserError
from fedlm.models.cut import ClientBottom
from fedlm.tasks import Task
from fedlm.tasks.base import model_inputs

Batch = dict[str, torch.Tensor]


def read_public_text(path: Path, limit: int) -> list[str]:
    """Up to ``limit`` text lines of the attacker's public corpus (wikitext's headings and blanks skipped)."""
    if not path.is_file():
        raise UserError(f"the attacker's public text {path} does not exist; give a text file with --public-text "
                        "(the default is wikitext-2/train.txt under the data directory)")
    lines: list[str] = []
    with path.open(encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if line and not line.startswith("="):
                lines.append(line)
                if len(lines) >= limit:
                    break
    return lines


def public_batches(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int,
                   batch_size: int = 64) -> list[Batch]:
    """The public texts tokenized as the run's clients tokenize (the run's tokenizer, its max_length)."""
    batches = []
    for i in range(0, len(texts), batch_size):
        batches.append(dict(tokenizer(list(texts[i : i + batch_size]), truncation=True, max_length=max_length,
                                      padding=True, return_tensors="pt")))
    return batches


def client_batches(task: Task, rows: Sequence[dict], limit: int, batch_size: int, seed: int) -> list[Batch]:
    """Up to ``limit`` of a client's training rows, collated as its local training collates them (masked LM's
    corruption included: the bottom sees what training fed it)."""
    generator = torch.Generator().manual_seed(seed)
    rows = list(rows)[:limit]
    return [task.collate(rows[i : i + batch_size], generator) for i in range(0, len(rows), batch_size)]


@torch.no_grad()
def boundary_set(bottom: ClientBottom, batches: Iterable[Batch], wire_dtype: torch.dtype,
                 training: bool = True) -> BoundarySet:
    """The bottom's output for each batch, cast to the wire's dtype and back (what the server decodes), with
    the ids that went in and the padding mask; batches of different lengths are padded to the longest.
    ``training``: computed as during local training (dropout on), which is how the real messages were sent
    and how an attacker would mimic them; the bottom's own mode is restored afterwards."""
    device = next(bottom.parameters()).device
    was_training = bottom.training
    bottom.train(training)
    try:
        outputs = [(bottom(**bottom_inputs(batch, device)), batch) for batch in batches]
    finally:
        bottom.train(was_training)
    hidden, ids, masks = [], [], []
    for sent, batch in outputs:
        hidden.append(sent.hidden.to(wire_dtype).float().cpu())
        ids.append(batch["input_ids"].cpu())
        mask = batch.get("attention_mask")
        masks.append(torch.ones_like(batch["input_ids"], dtype=torch.bool) if mask is None else mask.bool().cpu())
    if not hidden:
        return BoundarySet(torch.zeros(0, 0, 0), torch.zeros(0, 0, dtype=torch.long), torch.zeros(0, 0, dtype=bool))
    length = max(h.shape[1] for h in hidden)
    return BoundarySet(torch.cat([_pad(h, length) for h in hidden]), torch.cat([_pad(i, length) for i in ids]),
                       torch.cat([_pad(m, length) for m in masks]))


def bottom_inputs(batch: Batch, device: torch.device) -> Batch:
    """What ``ClientBottom.forward`` takes of a training batch (never the labels), on ``device``."""
    return {k: v.to(device) for k, v in model_inputs(batch).items()
            if k in ("input_ids", "attention_mask", "token_type_ids")}


def _pad(tensor: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - tensor.shape[1]
    if not extra:
        return tensor
    shape = (tensor.shape[0], extra, *tensor.shape[2:])
    return torch.cat([tensor, torch.zeros(shape, dtype=tensor.dtype)], dim=1)

