"""Sample-level DP-SGD for one client's local training, through Opacus (GradSampleModule + DPOptimizer).

Opacus computes each example's gradient, clips it to ``max_grad_norm`` and adds Gaussian noise of std
``noise_multiplier * max_grad_norm`` to the batch's sum before the optimizer steps. Everything it attaches to the
model (hooks, per-example gradients) is removed when the client's training ends, so the same model object then
evaluates and trains the next client as before.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fedlm.config.dp_support import SAMPLE_DP
from fedlm.errors import UserError
from fedlm.federation.opacus import require_opacus


def refuse_unsupported(family: str, task: str) -> None:
    """One line for a model family or task DP-SGD is not offered for (the config's table, once the task is
    known)."""
    refusal = SAMPLE_DP.refusal(family, task)
    if refusal is not None:
        raise UserError(refusal)


class BatchSize:
    """The current batch's size, told to the embedding hooks of :func:`per_example_lookups`."""

    def __init__(self) -> None:
        self.value = 0

    def of(self, batch: dict[str, Any]) -> None:
        first = next(v for v in batch.values() if isinstance(v, torch.Tensor))
        self.value = int(first.shape[0])


def per_example_lookups(model: torch.nn.Module, size: BatchSize) -> list[torch.utils.hooks.RemovableHandle]:
    """Embedding lookups of one row the model broadcasts over the batch (BERT's, DistilBERT's and GPT-2's position
    ids) become one row per example, so Opacus sees each example's activation (the sum is unchanged)."""

    def expand(module: torch.nn.Module, args: tuple) -> tuple | None:
        ids = args[0]
        if ids.dim() >= 2 and ids.shape[0] == 1 and size.value > 1:
            return (ids.expand(size.value, *ids.shape[1:]), *args[1:])
        return None

    return [m.register_forward_pre_hook(expand) for m in model.modules() if isinstance(m, torch.nn.Embedding)]


@contextmanager
def dp_sgd(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
           max_grad_norm: float, batch_size: int, seed: int) -> Iterator[tuple[torch.optim.Optimizer, BatchSize]]:
    """``optimizer`` as Opacus' DPOptimizer over ``model`` with per-example gradients; yields it and the
    :class:`BatchSize` to set before each forward. The noise stream is seeded by ``seed``."""
    grad_sample = require_opacus("grad_sample")
    optimizers = require_opacus("optimizers")
    size = BatchSize()
    handles = per_example_lookups(model, size)
    tracked = grad_sample.GradSampleModule(model, batch_first=True, loss_reduction="mean")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    private = optimizers.DPOptimizer(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                                     expected_batch_size=batch_size, loss_reduction="mean", generator=generator)
    try:
        with warnings.catch_warnings():  # Opacus' hooks on embeddings, whose integer inputs need no gradient
            warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
            yield private, size
    finally:
        tracked.cleanup()
        for handle in handles:
            handle.remove()
        for p in model.parameters():
            for attr in ("grad_sample", "summed_grad", "_forward_counter"):
                if hasattr(p, attr):
                    delattr(p, attr)


def fill_unused(optimizer: torch.optim.Optimizer, batch: int) -> None:
    """Zero per-example gradients for trainable parameters the loss did not reach (a pooler the head skips):
    Opacus needs one for every parameter it steps, and they contribute nothing but the noise."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and getattr(p, "grad_sample", None) is None:
                p.grad_sample = torch.zeros((batch, *p.shape), dtype=p.dtype, device=p.device)
