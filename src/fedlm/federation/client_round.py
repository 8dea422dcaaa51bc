"""A client's side of one round, shared by the in-process simulator and the Flower ClientApp.

decode what the server sent -> put the client's own local parameters back -> freeze this round's frozen
parameters -> train -> refuse a non-finite update -> encode the trained global part for upload; the local
part stays with the client and frozen parameters are not sent back.

A round with ``client_timeout_s`` runs each client's work through :func:`call_with_deadline`, which stops
waiting at the deadline whatever the client is doing (a step that never ends included).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

from fedlm.errors import UserError
from fedlm.federation.attacks import Attack
from fedlm.federation.codecs import Codec
from fedlm.federation.executor import ClientFailure, ClientJob, ClientReport
from fedlm.federation.local_training import ClientTimeout, train_locally
from fedlm.federation.params import NamedTensors, all_finite, load_into, snapshot
from fedlm.federation.strategies import ClientUpdate
from fedlm.tasks import Task

log = logging.getLogger("fedlm")

T = TypeVar("T")


class NonFiniteUpdate(RuntimeError):
    """A client's training produced NaN or Inf: its update must not reach the aggregate."""


class ClientAbandoned(ClientTimeout):
    """A client was still at work at its deadline and was cut off; it keeps the objects it was given."""


def call_with_deadline(work: Callable[[], T], timeout_s: float | None, name: str = "fedlm-client") -> T:
    """``work()``, run in a worker thread that is waited for at most ``timeout_s`` (None: inline, no limit).

    At the deadline the worker is abandoned and :class:`ClientAbandoned` raised; whatever it returns or
    raises later is dropped. It cannot be stopped from outside, so it keeps running until local training's
    own deadline check between steps ends it: callers must give it objects (a model, an optimizer) that
    nobody uses after it is abandoned. A daemon thread, so one that never returns does not hold the
    process open."""
    if not timeout_s:
        return work()
    outcome: dict[str, T | BaseException] = {}

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the caller, or dropped if it gave up on this worker
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ClientAbandoned(f"still working at its {timeout_s:g}s deadline; abandoned")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


@contextmanager
def frozen(model: torch.nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Turn off gradients for ``names`` while training (no weight-gradient compute, no optimizer state)."""
    params = dict(model.named_parameters()) if names else {}
    touched = [params[n] for n in names if params[n].requires_grad]
    for p in touched:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in touched:
            p.requires_grad_(True)


def stop_at_next_module(model: torch.nn.Module) -> None:
    """Make every later call of ``model``'s modules raise :class:`ClientAbandoned`, so an abandoned worker
    that comes back from a stuck step stops at its next module instead of computing (and drawing from
    torch's global random generator) alongside the clients after it. For a model nobody uses again."""

    def refuse(module: torch.nn.Module, args: object) -> None:
        raise ClientAbandoned(f"{type(module).__name__} called after its client was abandoned")

    for module in model.modules():
        module.register_forward_pre_hook(refuse)


def finite_update(model: torch.nn.Module, names: Sequence[str], metrics: dict[str, float], *,
                  borrow: bool = False) -> NamedTensors:
    """Snapshot the parameters a client is about to send, refusing NaN/Inf in its loss or in them (``borrow``:
    the model's own tensors, not copies; see :func:`fit_client`)."""
    if not math.isfinite(metrics["train_loss"]):
        raise NonFiniteUpdate(f"train loss is {metrics['train_loss']}")
    shared = snapshot(model, list(names), copy=not borrow)
    refuse_non_finite(shared)
    return shared


def refuse_non_finite(update: NamedTensors) -> None:
    """Raise :class:`NonFiniteUpdate` naming the first tensor of ``update`` that holds NaN or Inf.

    One sum per tensor screens them all: a NaN or Inf anywhere makes its tensor's sum NaN or Inf, and a sum reads
    each value once without the boolean copy ``isfinite`` makes (MiniLM: ~10 ms instead of ~150). Only a
    non-finite sum, which huge finite values can give too, sends the update to the value-by-value check."""
    floats = [t for t in update.values() if t.is_floating_point()]
    if not floats or torch.stack([t.sum() for t in floats]).isfinite().all():
        return
    bad = all_finite(update)
    if bad is not None:
        raise NonFiniteUpdate(f"parameter {bad} holds NaN or Inf")


def fit_client(model: torch.nn.Module, task: Task, rows: Sequence[dict], job: ClientJob, codec: Codec,
               local_state: NamedTensors | None, local_names: list[str], *,
               on_step: Callable[[], None] | None = None,
               attack: Attack | None = None, borrow: bool = False) -> tuple[ClientReport, NamedTensors]:
    """Run one client's round; returns what it uploads and its new local state. ``on_step`` is called after
    each local step (progress); ``attack``, if this client mounts it, changes what it uploads. ``borrow``: a
    lossless upload may be the model's own parameters rather than a copy, valid until the model trains again
    (the simulator's, whose engine folds each report before the next client runs; whoever keeps an update
    longer copies it, as the robust rules do)."""
    received = codec.decode(job.params)
    load_into(model, received)
    if local_state:
        load_into(model, local_state)
    deadline = job.deadline()
    skip = set(job.frozen)
    trained = [n for n in received if n not in skip]
    anchor = {n: received[n] for n in trained} if job.settings.mu > 0 else None
    with frozen(model, job.frozen):
        metrics = train_locally(model, task, rows, job.settings, seed=job.seed, anchor=anchor, deadline=deadline,
                                on_step=on_step)
    shared = finite_update(model, trained, metrics, borrow=borrow)
    if attack is not None:
        shared = attack.corrupt(job.client_id, received, shared, job.seed)
    encoded = codec.encode(shared)
    update = ClientUpdate(job.client_id, len(rows), codec.decode(encoded), metrics)
    local = snapshot(model, local_names) if local_names else {}
    return ClientReport(update, encoded.total_bytes, encoded.meta_bytes), local


def failure_reason(exc: BaseException) -> str:
    """How a client's failure reads in the run's records, wherever the client ran (simulator, split, Flower):
    timeouts and non-finite updates by name, anything else as the exception."""
    if isinstance(exc, ClientTimeout):
        return f"timeout: {exc}"
    if isinstance(exc, NonFiniteUpdate):
        return f"non-finite update: {exc}"
    return f"exception: {type(exc).__name__}: {exc}"


# Raised by code, not by a client's data, network or numbers: a bug, or a model fedlm cannot run this way (a
# decoder layer that wants an argument the split does not pass) -- every client would fail the same way.
LASTING_ERRORS = (TypeError, AttributeError, NameError, NotImplementedError, ImportError, AssertionError, UserError)


def client_failure(client_id: int, exc: BaseException) -> ClientFailure:
    """A client's exception as the engine's record of a left-out client (the traceback goes to the debug log)."""
    log.debug("client %d failed", client_id, exc_info=exc)
    return ClientFailure(client_id, failure_reason(exc), lasting=isinstance(exc, LASTING_ERRORS))
