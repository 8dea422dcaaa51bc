"""What the peer children of ``bench_peers.py`` share: the job, its data, fedlm's client step and its evaluation.

The peers (Flower, pfl) run in their own virtual environments, which have torch, transformers and tokenizers but
not fedlm, so this module imports nothing of fedlm. It restates the few rules of fedlm's FedAvg client that make
the jobs comparable (``fedlm.federation.local_training``): a fresh AdamW per client and round, every epoch a
``torch.randperm`` of the client's rows from a generator seeded by (run seed, round, client), dropout seeded the
same way, dynamic right-padding per batch, the gradient norm clipped before each step. With the same initial
weights, tokenizer and rows, a peer's clients then take the same steps fedlm's do, so the benchmark times the
frameworks and not different jobs. Evaluation is fedlm's too: the whole test set, longest rows first, in batches.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

RESULT_PREFIX = "PEER_RESULT "  # the one stdout line the parent reads


@dataclass(frozen=True)
class Job:
    """One FedAvg job as ``bench_peers.py`` wrote it (``job.json``)."""

    seed: int
    rounds: int
    batch_size: int
    lr: float
    local_epochs: int
    max_grad_norm: float
    max_length: int
    eval_batch_size: int
    tokenizer: str
    init_model: str
    train: str
    test: str
    clients: list[list[int]]  # each client's example indices into the train file, ascending (fedlm's order)

    @classmethod
    def load(cls, path: str | Path) -> Job:
        return cls(**json.loads(Path(path).read_text()))

    @property
    def num_clients(self) -> int:
        return len(self.clients)


Row = tuple[list[int], list[int], int]  # input ids, token type ids, label


def set_threads() -> None:
    """One intra-op thread per process, whatever the launcher set: the benchmark gives every framework the same
    thread budget per process, and the parent decides the number of processes."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_rows(job: Job, split: str) -> tuple[list[Row], int]:
    """One split's rows as fedlm's classification task makes them (truncated to ``max_length``, no padding yet)
    with the tokenizer fedlm trained for the job, and that tokenizer's pad id."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.tokenizer)
    records = read_jsonl(job.train if split == "train" else job.test)
    encoded = tokenizer([r["text"] for r in records], truncation=True, max_length=job.max_length)
    types = encoded.get("token_type_ids") or [[0] * len(ids) for ids in encoded["input_ids"]]
    rows = [(ids, tt, int(r["label"])) for ids, tt, r in zip(encoded["input_ids"], types, records, strict=True)]
    return rows, int(tokenizer.pad_token_id)


def client_rows(train_rows: list[Row], job: Job, client_id: int) -> list[Row]:
    return [train_rows[i] for i in job.clients[client_id]]


def build_model(job: Job) -> torch.nn.Module:
    """The initial model fedlm built for this job (same config, same seeded weights), saved by the parent."""
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(job.init_model)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train and travel (fedlm sends the trainable parameters, not the int buffers)."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def local_seed(seed: int, round_idx: int, client_id: int) -> int:
    """fedlm's per-(run seed, round, client) seed, so a peer's client draws the same batch order and dropout."""
    mixed = (seed * 1_000_003 + round_idx) * 1_000_033 + client_id
    return mixed % (2**63 - 1)


def batch_order(num_rows: int, job: Job, generator: torch.Generator) -> list[list[int]]:
    """Each epoch a fresh permutation cut into batches (fedlm's ``batch_order`` without length grouping)."""
    batches = []
    for _ in range(job.local_epochs):
        order = torch.randperm(num_rows, generator=generator).tolist()
        batches.extend(order[i:i + job.batch_size] for i in range(0, num_rows, job.batch_size))
    return batches


def collate(rows: list[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest row (fedlm's ``pad_inputs``)."""
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    types = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_types, _) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        types[i, :len(row_types)] = torch.tensor(row_types)
        mask[i, :len(row_ids)] = 1
    labels = torch.tensor([label for _, _, label in rows], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels}


def classification_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    return F.cross_entropy(model(**inputs).logits.float(), batch["labels"])


def train_client(model: torch.nn.Module, rows: list[Row], job: Job, round_idx: int, client_id: int,
                 pad_id: int) -> tuple[float, int]:
    """One client's local training in place, as fedlm's FedAvg client does it; (summed loss, examples seen)."""
    seed = local_seed(job.seed, round_idx, client_id)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=job.lr, weight_decay=0.0)
    loss_sum, seen = 0.0, 0
    for batch_rows in batch_order(len(rows), job, generator):
        batch = collate([rows[i] for i in batch_rows], pad_id)
        loss = classification_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
        optimizer.step()
        loss_sum += float(loss.detach()) * len(batch_rows)
        seen += len(batch_rows)
    return loss_sum, seen


def eval_batches(rows: list[Row], job: Job, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """The test set in fedlm's evaluation order (longest first), collated once."""
    ordered = sorted(rows, key=lambda row: -len(row[0]))
    return [collate(ordered[i:i + job.eval_batch_size], pad_id) for i in range(0, len(ordered), job.eval_batch_size)]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Example-weighted test loss and accuracy over every batch; leaves the model in train mode."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for batch in batches:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        logits = model(**inputs).logits.float()
        loss_sum += float(F.cross_entropy(logits, batch["labels"])) * len(batch["labels"])
        correct += int((logits.argmax(-1) == batch["labels"]).sum())
        count += len(batch["labels"])
    model.train()
    return {"loss": loss_sum / count, "accuracy": correct / count}


class Clock:
    """The rounds' span as every arm reports it: from the end of the round-0 evaluation (``start_rounds``) to the
    end of each round, its evaluation included (``lap``), so the first round's one-time costs (a Ray actor's
    imports, say) show apart from the rounds after it."""

    def __init__(self) -> None:
        self.process_start = time.perf_counter()
        self.rounds_start: float | None = None
        self.laps: list[float] = []

    def start_rounds(self) -> None:
        self.rounds_start = time.perf_counter()

    def lap(self) -> None:
        self.laps.append(time.perf_counter())

    def round_s(self) -> list[float]:
        if self.rounds_start is None:
            return []
        edges = [self.rounds_start, *self.laps]
        return [end - begin for begin, end in itertools.pairwise(edges)]


def report(clock: Clock, **fields: Any) -> None:
    """The result line the parent parses (flushed, since the peers' own logging is chatty)."""
    rounds = clock.round_s()
    payload = {"rounds_s": sum(rounds) if rounds else None, "round_s": rounds,
               "in_process_s": time.perf_counter() - clock.process_start, **fields}
    print(RESULT_PREFIX + json.dumps(payload), flush=True)
