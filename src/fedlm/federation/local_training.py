"""Local training on one client's data: the same code serves centralized, simulated and Flower clients.

A client starts each round from the parameters it is sent, with a fresh optimizer (clients keep no
optimizer state between rounds, as in FedAvg), and trains for local epochs or a fixed number of steps.
All randomness (data order, masking, dropout) comes from one seed per (run seed, round, client).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from fedlm.config import TrainConfig
from fedlm.federation.dp_sgd import dp_sgd, fill_unused
from fedlm.federation.params import NamedTensors
from fedlm.models.device import autocast, grad_scaler, model_device
from fedlm.tasks import Task
from fedlm.tasks.base import Batch


class ClientTimeout(RuntimeError):
    """Raised inside local training when the round's deadline passes."""


def local_seed(seed: int, round_idx: int, client_id: int) -> int:
    """A 63-bit seed unique to (run seed, round, client), stable across processes and resumes."""
    mixed = (seed * 1_000_003 + round_idx) * 1_000_033 + client_id
    return mixed % (2**63 - 1)


@dataclass(frozen=True)
class LocalSettings:
    optimizer: str = "adamw"
    lr: float = 5e-4
    weight_decay: float = 0.0
    momentum: float = 0.0
    batch_size: int = 16
    local_epochs: int = 1
    local_steps: int | None = None
    max_grad_norm: float | None = 1.0
    group_by_length: bool = False
    precision: str = "fp32"  # train.precision; the device is the model's own (see fedlm.run.prepare)
    mu: float = 0.0
    dp_noise_multiplier: float | None = None  # privacy.kind sample: DP-SGD through Opacus (None: plain training)
    dp_max_grad_norm: float = 1.0  # ... each example's gradient clipped to this L2 norm

    @classmethod
    def from_config(cls, train: TrainConfig) -> LocalSettings:
        """The run's ``train`` section; what a strategy adds (FedProx's mu, DP-SGD's noise) comes from its
        ``configure`` each round."""
        return cls(**{k: getattr(train, k) for k in cls.__dataclass_fields__ if hasattr(train, k)})


def round_lr(lr: float, schedule: str, round_idx: int, rounds: int) -> float:
    """The learning rate of round ``round_idx`` (from 1) of ``rounds`` under ``train.lr_schedule``. Decaying the
    clients' step size over the rounds is what FedAvg's convergence under client heterogeneity asks for; it
    is a function of the round alone, so a resumed run continues the same schedule."""
    if schedule == "constant" or rounds <= 1:
        return lr
    if schedule == "linear":
        return lr * (rounds - round_idx + 1) / rounds
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * (round_idx - 1) / rounds))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def make_optimizer(params: list[torch.nn.Parameter], settings: LocalSettings) -> torch.optim.Optimizer:
    """A fresh optimizer over ``params``. ``foreach=True`` (torch's default only on GPUs): on the CPU it runs the
    very same per-tensor arithmetic as the default, so the step is bitwise the same, with less Python per tensor
    and fewer fresh temporaries (MiniLM's AdamW step ~25% faster, a centralized epoch ~7%)."""
    if settings.optimizer == "sgd":
        return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum,
                               weight_decay=settings.weight_decay, foreach=True)
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, foreach=True)


_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.optim.Optimizer]] = weakref.WeakKeyDictionary()


def renewed_optimizer(model: torch.nn.Module, params: list[torch.nn.Parameter],
                      settings: LocalSettings) -> torch.optim.Optimizer:
    """``make_optimizer(params, settings)`` for training that keeps its optimizer to itself (the next call takes it
    back): the AdamW of ``model``'s last call, if it holds the same parameters and settings, returns with its state
    zeroed in place, the state a new one starts from. A new AdamW allocates two model-sized buffers at its first
    step, and buffers past glibc's mmap threshold page-fault afresh each time (MiniLM: ~140 ms a client, against
    ~20 ms to zero them)."""
    key = (settings.optimizer, settings.lr, settings.weight_decay, tuple(map(id, params)))
    kept = _KEPT.get(model)
    if kept is not None and kept[0] == key:
        for state in kept[1].state.values():
            for value in state.values():
                value.zero_()
        return kept[1]
    optimizer = make_optimizer(params, settings)
    if settings.optimizer == "adamw":  # SGD's momentum buffer starts as a copy of the first gradient, not zeros
        _KEPT[model] = (key, optimizer)
    return optimizer


def seed_dropout(seed: int, device: torch.device) -> None:
    """Seed the generator dropout draws from on ``device``. A CPU model draws only from the CPU's generator;
    ``torch.manual_seed`` seeds every backend's too and, while CUDA is not initialized, formats a stack trace to
    queue that seed (0.3 ms and more a client, a share of a tiny model's step worth saving)."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def batch_order(num_rows: int, settings: LocalSettings, generator: torch.Generator,
                lengths: Sequence[int] | None = None) -> list[list[int]]:
    """Batches of row indices: shuffled each epoch; local_steps (if set) cycles epochs until reached.

    With ``settings.group_by_length`` and the rows' ``lengths``, each epoch's shuffled order is cut into
    megabatches of ``MEGABATCH`` batches, each sorted by length before it is cut into batches, and the
    batches are then shuffled: batches hold examples of similar length, so dynamic padding wastes little
    (SST-2 sentences: 2.6-3x fewer padded tokens), while which examples meet in a batch stays random.
    The number of batches is the same either way.
    """
    grouped = settings.group_by_length and lengths is not None
    batches: list[list[int]] = []
    epochs = settings.local_epochs
    while True:
        for _ in range(epochs):
            order = torch.randperm(num_rows, generator=generator).tolist()
            batches.extend(_length_grouped(order, lengths, settings.batch_size, generator) if grouped
                           else _cut(order, settings.batch_size))
        if settings.local_steps is None:
            return batches
        if len(batches) >= settings.local_steps:
            return batches[: settings.local_steps]
        epochs = 1


MEGABATCH = 50  # batches per length-sorted group, as in transformers' LengthGroupedSampler


def _cut(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _length_grouped(order: list[int], lengths: Sequence[int], batch_size: int,
                    generator: torch.Generator) -> list[list[int]]:
    span = MEGABATCH * batch_size
    batches = [batch for start in range(0, len(order), span)
               for batch in _cut(sorted(order[start:start + span], key=lambda i: -lengths[i]), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def row_lengths(rows: Sequence[dict]) -> list[int] | None:
    """Token counts of pre-tokenized rows (None for rows without ``input_ids``), for ``batch_order``."""
    if not rows or "input_ids" not in rows[0]:
        return None
    return [len(row["input_ids"]) for row in rows]


def proximal_term(model: torch.nn.Module, anchor: NamedTensors) -> torch.Tensor:
    """sum ||w - w_anchor||^2 over the anchored parameters (FedProx)."""
    params = dict(model.named_parameters())
    terms = [(params[n] - a).pow(2).sum() for n, a in anchor.items()]
    return torch.stack(terms).sum()


def check_deadline(deadline: float | None, steps: int) -> None:
    """Raise :class:`ClientTimeout` once the round's deadline (a ``time.monotonic()`` value) has passed."""
    if deadline is not None and time.monotonic() > deadline:
        raise ClientTimeout(f"local training passed its deadline after {steps} steps")


def clip_and_step(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
                  max_grad_norm: float | None, scaler: torch.amp.GradScaler | None = None) -> None:
    """Clip the gradient norm of ``params`` (if asked) and apply the optimizer step. With an fp16 loss
    ``scaler`` the gradients are unscaled first, so clipping sees their true norm, and a step whose
    gradients overflowed is skipped (the scaler then lowers its scale)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


class LossTally:
    """The metrics every local-training loop reports: example-weighted train loss, steps, examples."""

    def __init__(self) -> None:
        self.loss_sum, self.units, self.steps = 0.0, 0, 0

    def add(self, loss: torch.Tensor, count: int) -> None:
        self.loss_sum += float(loss.detach()) * count
        self.units += count
        self.steps += 1

    def metrics(self, examples: int) -> dict[str, float]:
        return {"train_loss": self.loss_sum / max(self.units, 1), "steps": float(self.steps),
                "examples": float(examples)}


class LocalLoop:
    """The loop that plain, private (DP-SGD) and split local training share, so each keeps only its own step.

    Built before anything else draws random numbers: the batch order and ``collate``'s masking draw from
    ``generator`` and dropout from torch's global seed, so every kind of training sees the same draws and the
    equivalence tests (split == unsplit, one-client FedAvg == centralized) hold bitwise. Iterating yields each
    batch collated (after checking the deadline); the step reports its loss with :meth:`done`.
    """

    def __init__(self, model: torch.nn.Module, task: Task, rows: Sequence[dict], settings: LocalSettings, seed: int,
                 *, params: Iterable[torch.nn.Parameter] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, deadline: float | None = None,
                 on_step: Callable[[], None] | None = None, grouped: bool = True, renew: bool = False) -> None:
        """``params``: the parameters to train (default the model's); ``optimizer``: one carried from an earlier
        turn (default a fresh one over them); ``grouped=False`` keeps plain shuffles under ``group_by_length``;
        ``renew``: the fresh optimizer never leaves the caller, so it may be the model's last one renewed."""
        self.generator = torch.Generator().manual_seed(seed)
        self.device = model_device(model)
        seed_dropout(seed, self.device)
        if not all(m.training for m in model.modules()):  # cheaper than train()'s call into every module, and
            model.train()  # from the second client on the model is training already
        self.trainable = [p for p in (model.parameters() if params is None else params) if p.requires_grad]
        if optimizer is None:
            optimizer = (renewed_optimizer(model, self.trainable, settings) if renew
                         else make_optimizer(self.trainable, settings))
        self.optimizer = optimizer
        self.task, self.rows, self.settings, self.deadline, self.on_step = task, rows, settings, deadline, on_step
        self.lengths = row_lengths(rows) if settings.group_by_length and grouped else None
        self.tally = LossTally()

    def __iter__(self) -> Iterator[Batch]:
        for batch_rows in batch_order(len(self.rows), self.settings, self.generator, self.lengths):
            check_deadline(self.deadline, self.tally.steps)
            yield self.task.collate([self.rows[i] for i in batch_rows], self.generator)

    def done(self, loss: torch.Tensor, count: int) -> None:
        """Tally a finished step's loss (a mean over ``count`` units) and tell ``on_step``."""
        self.tally.add(loss, count)
        if self.on_step is not None:
            self.on_step()

    def metrics(self) -> dict[str, float]:
        return self.tally.metrics(len(self.rows))


def train_locally(model: torch.nn.Module, task: Task, rows: Sequence[dict], settings: LocalSettings, *,
                  seed: int, anchor: NamedTensors | None = None, deadline: float | None = None,
                  on_step: Callable[[], None] | None = None) -> dict[str, float]:
    """Train ``model`` in place on ``rows`` (pre-tokenized examples); return train loss and counts."""
    if settings.dp_noise_multiplier is not None:
        return train_privately(model, task, rows, settings, seed=seed, deadline=deadline, on_step=on_step)
    loop = LocalLoop(model, task, rows, settings, seed, deadline=deadline, on_step=on_step, renew=True)
    device = loop.device
    scaler = grad_scaler(device, settings.precision)
    anchor = {n: a.to(device) for n, a in anchor.items()} if settings.mu > 0 and anchor is not None else None
    for batch in loop:
        with autocast(device, settings.precision):
            loss, count = task.loss(model, batch)
        objective = loss if anchor is None else loss + 0.5 * settings.mu * proximal_term(model, anchor)
        loop.optimizer.zero_grad(set_to_none=True)
        (objective if scaler is None else scaler.scale(objective)).backward()
        clip_and_step(loop.optimizer, loop.trainable, settings.max_grad_norm, scaler)
        loop.done(loss, count)
    loop.optimizer.zero_grad(set_to_none=True)  # the renewed optimizer's state stays; the last gradients need not
    return loop.metrics()


def train_privately(model: torch.nn.Module, task: Task, rows: Sequence[dict], settings: LocalSettings, *,
                    seed: int, deadline: float | None = None,
                    on_step: Callable[[], None] | None = None) -> dict[str, float]:
    """``train_locally`` as DP-SGD (privacy.kind sample): the same batches, each example's gradient clipped to
    ``dp_max_grad_norm`` and Gaussian noise added by Opacus' DPOptimizer (fp32, no proximal term: the config
    refuses both). ``steps`` in the result is what the privacy accountant composes over. Batches are plain
    shuffles even under ``group_by_length``: the accountant takes them as random samples of the rows."""
    loop = LocalLoop(model, task, rows, settings, seed, deadline=deadline, on_step=on_step, grouped=False)
    with dp_sgd(model, loop.optimizer, noise_multiplier=float(settings.dp_noise_multiplier),
                max_grad_norm=settings.dp_max_grad_norm, batch_size=min(settings.batch_size, len(rows)),
                seed=local_seed(seed, 0, 0x5347)) as (optimizer, size):
        for batch in loop:
            size.of(batch)
            loss, count = task.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            fill_unused(optimizer, size.value)
            optimizer.step()
            loop.done(loss, count)
    return loop.metrics()
