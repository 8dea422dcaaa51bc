"""What a run shows while it works.

On a terminal (stderr is a TTY): a bar over rounds, a bar over the current round's local steps (the sampled
clients' steps together, naming the client at work), and a bar over evaluation batches once an evaluation has
run a few seconds. Always, on stdout: a start line and one line per round, so a log or a pipe gets those lines
and no bars.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fedlm.federation.engine import ClientFailure, ClientJob, ClientReport, Executor, RoundPlan
from fedlm.federation.local_training import LocalSettings, batch_order
from fedlm.federation.params import NamedTensors
from fedlm.split.trunk import TO_CLIENT

EVAL_BAR_DELAY_S = 3.0  # an evaluation shorter than this shows no bar
Evaluate = Callable[[int, NamedTensors, list[int]], dict[str, Any]]  # the engine's evaluate hook


def interactive() -> bool:
    """Bars only where someone watches them: a log or a pipe would get every redraw as text."""
    return sys.stderr.isatty()


def say(line: str) -> None:
    """A line on stdout that leaves any bars on the terminal intact, written at once even into a pipe."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def announce(name: str, kind: str, plan: RoundPlan, num_clients: int, start_round: int, run_dir: Path) -> None:
    """The start line: what runs, for how long, and where it writes."""
    if start_round > 1:
        span = f"resuming at round {start_round} of {plan.rounds}"
    else:
        span = f"{plan.rounds} round{'s' if plan.rounds != 1 else ''}"
    say(f"[{name}] {kind}: {span}, {plan.clients_per_round} of {num_clients} clients per round; "
        f"writing {run_dir}")


def local_steps(num_rows: int, settings: LocalSettings) -> int:
    """The steps a client with ``num_rows`` examples takes in a round: as many batches as ``batch_order``
    gives it (the generator only shuffles, so any will do)."""
    return len(batch_order(num_rows, settings, torch.Generator())) if num_rows else 0


class RoundProgress:
    """The bars of one run (drawn on a terminal only) and its line per round.

    A round's step total is known when its clients start (:class:`WatchedExecutor`); steps are then heard of
    one by one (``step`` from in-process clients, ``boundary_message`` from split clients), and whatever a
    client did not report step by step (a client on another machine, or one that failed) counts when it is
    done.
    """

    def __init__(self, name: str, rounds: int, start_round: int, metric: str) -> None:
        self.name, self.rounds, self.metric = name, rounds, metric
        self.shown = interactive()
        self.rounds_bar = self._bar(total=rounds, initial=start_round - 1, desc=f"{name} rounds", unit="round")
        self.steps_bar: tqdm | None = None  # from the first round's clients on
        self.eval_bar: tqdm | None = None
        self.round = 0
        self.remaining: dict[int, int] = {}  # steps each client of the round has yet to report
        self.lock = threading.Lock()  # split clients' messages may arrive from transport threads

    def _bar(self, **kwargs: Any) -> tqdm:
        return tqdm(disable=not self.shown, dynamic_ncols=True, **kwargs)

    def clients_started(self, round_idx: int, steps: dict[int, int]) -> None:
        """Clients start training (again, on a retried attempt): their steps join the round's total."""
        with self.lock:
            if round_idx != self.round:
                self.round = round_idx
                self.remaining = {}
                if self.steps_bar is not None:
                    self.steps_bar.close()
                self.steps_bar = self._bar(total=0, desc=f"round {round_idx}", unit="step", leave=False)
            self.steps_bar.total += sum(steps.values())
            self.remaining.update(steps)
            self.steps_bar.refresh()

    def step(self, client_id: int) -> None:
        """One local step of ``client_id`` is done."""
        with self.lock:
            self.remaining[client_id] = self.remaining.get(client_id, 0) - 1
            if self.steps_bar is not None:
                self.steps_bar.set_postfix_str(f"client {client_id}", refresh=False)
                self.steps_bar.update(1)

    def boundary_message(self, direction: str, client_id: str, kind: str, tensors: dict[str, Any]) -> None:
        """A split executor's message hook: a split client's step ends with the trunk's answer to its backward."""
        del tensors
        if direction == TO_CLIENT and kind == "backward":
            self.step(int(client_id))

    def client_done(self, client_id: int) -> None:
        """``client_id`` finished (or failed): its steps not heard of one by one count now."""
        with self.lock:
            left = self.remaining.pop(client_id, 0)
            if left > 0 and self.steps_bar is not None:
                self.steps_bar.update(left)

    def evaluating(self, evaluate: Evaluate) -> Evaluate:
        """``evaluate`` with a bar over its batches (fed by ``eval_batch``) that shows once it runs long."""

        def shown(round_idx: int, params: NamedTensors, clients: list[int]) -> dict[str, Any]:
            self.eval_bar = self._bar(total=0, desc=f"round {round_idx} evaluation", unit="batch", leave=False,
                                      delay=EVAL_BAR_DELAY_S)
            try:
                return evaluate(round_idx, params, clients)
            finally:
                self.eval_bar.close()
                self.eval_bar = None

        return shown

    def eval_batch(self, done: int, batches: int) -> None:
        """``Task.evaluate``'s callback: batch ``done`` of ``batches`` scored (one data set of the evaluation)."""
        if self.eval_bar is None:
            return
        if done == 1:
            self.eval_bar.total += batches
        self.eval_bar.update(1)

    def round_done(self, round_idx: int, record: dict[str, Any]) -> None:
        """The engine's on_round hook: advance the rounds bar and write the round's line."""
        scores = {k: f"{v:.4f}" for k, v in record.items() if k.startswith(("test_", "local_")) and self.metric in k
                  and not k.endswith("by_client")}
        loss = f"{record['train_loss']:.4f}"
        self.rounds_bar.update(1)
        self.rounds_bar.set_postfix(scores | {"loss": loss})
        shown = "".join(f" {k}={v}" for k, v in scores.items())
        say(f"[{self.name}] round {round_idx}/{self.rounds} train_loss={loss}{shown} wall={record['wall_s']:.1f}s")

    def watch(self, executor: Executor, client_rows: dict[int, Sequence[dict]]) -> Executor:
        """``executor``, telling this progress each round's clients and their steps as it starts them."""
        return WatchedExecutor(executor, self, client_rows)

    def close(self) -> None:
        if self.steps_bar is not None:
            self.steps_bar.close()
        self.rounds_bar.close()


class WatchedExecutor:
    """An executor whose jobs' local steps make the round's step total, wherever the clients run."""

    def __init__(self, inner: Executor, progress: RoundProgress, client_rows: dict[int, Sequence[dict]]) -> None:
        self.inner = inner
        self.progress = progress
        self.client_rows = client_rows

    def run(self, jobs: list[ClientJob]) -> list[ClientReport | ClientFailure]:
        if jobs:
            steps = {job.client_id: local_steps(len(self.client_rows[job.client_id]), job.settings) for job in jobs}
            self.progress.clients_started(jobs[0].round_idx, steps)
        return self.inner.run(jobs)

    def close(self) -> None:
        self.inner.close()
