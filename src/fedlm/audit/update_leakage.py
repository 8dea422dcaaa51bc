"""Update leakage: a client's upload holds its embedding matrix, and only the rows of tokens it fed get a
gradient, so the rows that changed since the server's broadcast name the tokens of its private text
(Gupta et al. 2022, the attack FL-GLM cites). The audit recomputes one round's upload of each client from the
run's checkpoint and partition, as the server received it (through the run's codec), and scores the
recovered token set against the tokens the client really trained on."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedlm.audit.scores import set_precision_recall
from fedlm.federation.params import NamedTensors


def embedding_name(model: torch.nn.Module) -> str:
    """The parameter name of the model's input token embeddings (as the engine names parameters)."""
    weight = model.get_input_embeddings().weight
    for name, param in model.named_parameters():
        if param is weight:
            return name
    raise RuntimeError(f"{type(model).__name__}'s input embeddings are not among its parameters")


def tied_to_output(model: torch.nn.Module) -> bool:
    """The input embeddings are also the output layer: every row then gets a gradient through the softmax,
    and changed rows say nothing about the text."""
    out = model.get_output_embeddings()
    return out is not None and out.weight is model.get_input_embeddings().weight


def changed_rows(before: Tensor, after: Tensor, tol: float = 0.0) -> set[int]:
    """Indices of the rows of an embedding matrix that moved by more than ``tol`` in any coordinate."""
    moved = (after.float() - before.float()).abs().amax(dim=1) > tol
    return set(torch.nonzero(moved).flatten().tolist())


def fed_tokens(rows: Iterable[dict]) -> set[int]:
    """Every token id in a client's training rows (their real tokens; padding is added later, by collation)."""
    return {int(t) for row in rows for t in row["input_ids"]}


@dataclass(frozen=True)
class Upload:
    """One client's upload as the server decoded it, next to what the server had sent that client."""

    client_id: int
    sent: NamedTensors
    received: NamedTensors


def leakage(upload: Upload, embedding: str, true_tokens: set[int], tol: float = 0.0) -> dict:
    """Precision / recall of the token set an upload's changed embedding rows reveal; ``sent_embedding``
    false when the upload holds no embeddings (frozen, kept local, or an adapter trains other weights)."""
    if embedding not in upload.received or embedding not in upload.sent:
        return {"client": upload.client_id, "sent_embedding": False}
    recovered = changed_rows(upload.sent[embedding], upload.received[embedding], tol)
    return {"client": upload.client_id, "sent_embedding": True, **set_precision_recall(recovered, true_tokens)}


def summarise(rows: Sequence[dict]) -> dict:
    """Mean precision and recall over the clients whose uploads held embeddings."""
    scored = [r for r in rows if r.get("sent_embedding")]
    if not scored:
        return {"clients_with_embeddings": 0}
    return {"clients_with_embeddings": len(scored),
            "precision": sum(r["precision"] for r in scored) / len(scored),
            "recall": sum(r["recall"] for r in scored) / len(scored)}
