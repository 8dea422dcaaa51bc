"""A split-learning client's local training: the same batches as ``train_locally``, but every batch crosses
the boundary twice (activations up, their gradient down) through a :class:`~fedlm.split.transport.Transport`.

``client_steps`` is a generator that yields at each message and resumes with the trunk's answer, so one
client can be driven alone (``drive``), several in lockstep against a batching trunk (``drive_lockstep``),
or on its own machine against a remote trunk (``run_client_turn``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
from torch import Tensor

from fedlm.federation.client_round import ClientAbandoned, call_with_deadline, finite_update
from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.executor import ClientJob, ClientReport
from fedlm.federation.local_training import LocalLoop, LocalSettings, clip_and_step
from fedlm.federation.params import load_into
from fedlm.federation.strategies import ClientUpdate
from fedlm.models.cut import Activations, SplitModel
from fedlm.models.device import autocast, model_device
from fedlm.split.transport import Transport
from fedlm.tasks import Task
from fedlm.tasks.base import model_inputs, to_device

BOUNDARY_UP, BOUNDARY_DOWN = "boundary_bytes_up", "boundary_bytes_down"  # a remote client's report metrics
Request = tuple[str, int, Activations | Tensor]  # ("forward", step, Activations) or ("backward", step, gradient)
Answer = Activations | Tensor  # the trunk output for a forward, the input gradient for a backward
Steps = Generator[Request, Answer | None, dict[str, float]]


def client_steps(client: SplitModel, task: Task, rows: Sequence[dict], settings: LocalSettings, seed: int,
                 deadline: float | None = None, optimizer: torch.optim.Optimizer | None = None) -> Steps:
    """One client's local training, yielding at every message to the trunk and resuming with the answer.

    The same batches, masking and dropout draws as ``train_locally`` (same seeding, same order of forward
    computations), so driven against a trunk in this process it reproduces the unsplit step. Gradient
    clipping applies to the client's own parameters (the trunk clips its own). ``optimizer``, if given,
    holds the client's parameters and state carried from an earlier turn; otherwise a fresh one is made.
    The bottom and top compute on the client model's device under ``settings.precision``'s autocast.
    """
    loop = LocalLoop(client.model, task, rows, settings, seed, params=client.client_parameters(), optimizer=optimizer,
                     deadline=deadline)
    device = model_device(client.model)
    for step, batch in enumerate(loop):
        batch = to_device(batch, client.model)
        with autocast(device, settings.precision):
            sent = client.bottom(**model_inputs(batch))
        top_in: Activations = yield ("forward", step, sent)
        with autocast(device, settings.precision):
            loss, count = task.loss_from_hidden(client.model, client.top(top_input(top_in, device)), batch)
        loop.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad: Tensor = yield ("backward", step, top_in.hidden.grad)
        if sent.hidden.requires_grad:  # else a frozen bottom (an adapter, no client blocks below the cut)
            sent.hidden.backward(grad.to(device))
        clip_and_step(loop.optimizer, loop.trainable, settings.max_grad_norm)
        loop.done(loss, count)
    return loop.metrics()


def top_input(answer: Activations, device: torch.device) -> Activations:
    """The trunk's answer as the top takes it: on the client's device (the wire delivers it on the CPU), and
    a view rather than the received leaf itself, because autocast caches its 16-bit cast of a leaf that needs
    grad and would then sum the gradients of its several uses in 16 bits, not 32 as the unsplit model does.
    Both stay in the graph: the gradient to send back still collects in ``answer.hidden.grad``."""
    return dataclasses.replace(answer, hidden=answer.hidden.to(device).view_as(answer.hidden))


def run_client_turn(client: SplitModel, task: Task, rows: Sequence[dict], job: ClientJob, codec: Codec,
                    transport: Transport) -> tuple[ClientReport, Encoded]:
    """A client's turn on its own machine: load the parts it was sent, train them against the remote trunk,
    and encode the same parts for upload; the boundary's byte counts ride along in the metrics."""
    load_into(client.model, codec.decode(job.params))
    try:
        metrics = drive(client_steps(client, task, rows, job.settings, job.seed, job.deadline()), transport)
    finally:
        transport.close()
    shared = finite_update(client.model, list(job.params.tensors), metrics)
    metrics |= {BOUNDARY_UP: float(transport.bytes_sent), BOUNDARY_DOWN: float(transport.bytes_received)}
    encoded = codec.encode(shared)
    update = ClientUpdate(job.client_id, len(rows), shared, metrics)
    return ClientReport(update, encoded.total_bytes, encoded.meta_bytes), encoded


def cut_off_at(steps: Steps, deadline: float | None, timeout_s: float | None, name: str = "fedlm-split") -> Steps:
    """``steps`` with each of its stretches of client computation run in a worker thread that is waited for
    only until ``deadline`` (a ``time.monotonic()`` value): a client stuck inside a step is abandoned there
    with :class:`ClientAbandoned`, whatever it is doing. The trunk's answers are fetched by the caller, so
    the trunk's time counts against the client's deadline but is never cut off mid-exchange. Without a
    deadline, ``steps`` itself."""
    if deadline is None:
        return steps
    return _cut_off_at(steps, deadline, timeout_s, name)


def _cut_off_at(steps: Steps, deadline: float, timeout_s: float | None, name: str) -> Steps:
    answer: Answer | None = None
    while True:
        try:
            request = call_with_deadline(partial(steps.send, answer), max(deadline - time.monotonic(), 1e-3), name)
        except StopIteration as stop:
            return stop.value
        except ClientAbandoned:
            raise ClientAbandoned(f"still working at its {timeout_s:g}s deadline; abandoned") from None
        answer = yield request


def call_trunk(transport: Transport, request: Request) -> Answer:
    """Deliver one request through ``transport`` and return the trunk's answer."""
    kind, step, payload = request
    return transport.forward(step, payload) if kind == "forward" else transport.backward(step, payload)


def drive(steps: Steps, transport: Transport) -> dict[str, float]:
    """Run one client's steps to the end, answering each request through ``transport``."""
    answer = None
    while True:
        try:
            request = steps.send(answer)
        except StopIteration as stop:
            return stop.value
        answer = call_trunk(transport, request)


def drive_lockstep(steps: dict[int, Steps], transports: dict[int, Transport],
                   pool: ThreadPoolExecutor) -> dict[int, dict[str, float] | BaseException]:
    """Run several clients against a client-batch trunk, one message each per trunk step.

    Client computation runs here, one client after another in a fixed order (so dropout draws are
    reproducible); only the transport calls run concurrently, because the trunk answers once every
    client's message is in. A client that finishes or fails closes its transport, leaving the batch.
    """
    answers: dict[int, Answer | None] = dict.fromkeys(steps)
    outcomes: dict[int, dict[str, float] | BaseException] = {}
    active = list(steps)
    while active:
        requests: dict[int, Request] = {}
        for cid in active:
            try:
                requests[cid] = steps[cid].send(answers[cid])
            except StopIteration as stop:
                outcomes[cid] = stop.value
                transports[cid].close()
            except Exception as exc:
                outcomes[cid] = exc
                transports[cid].close()
        futures = {cid: pool.submit(call_trunk, transports[cid], request) for cid, request in requests.items()}
        active = []
        for cid, future in futures.items():
            try:
                answers[cid] = future.result()
                active.append(cid)
            except Exception as exc:
                outcomes[cid] = exc
                transports[cid].close()
    return outcomes
