"""What a run shows while it works.

On a terminal (stderr is a TTY): a bar over rounds, a bar over the current round's local steps (the sampled
clients' steps together, naming the client at work), and a bar over evaluation batches once an evaluation has
run a few seconds. Always, on stdout: a start line and one line per round, so a log or a pipe gets those lines
and no bars.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from fedlm.federation.engine import RoundPlan
from fedlm.federation.executor import ClientJob
from fedlm.federation.local_training import LocalSettings, batch_order
from fedlm.federation.observer import RoundObserver
from fedlm.federation.records import RoundRecord

EVAL_BAR_DELAY_S = 3.0  # an evaluation shorter than this shows no bar


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


class RoundProgress(RoundObserver):
    """The bars of one run (drawn on a terminal only) and its line per round: the run's round observer.

    A round's step total is known when its clients start (from their rows and the round's settings); steps are
    then heard of one by one (``client_step``, from in-process and split clients alike), and whatever a client
    did not report step by step (a client on another machine, or one that failed) counts when it is done.
    """

    def __init__(self, name: str, rounds: int, start_round: int, metric: str,
                 client_rows: dict[int, Sequence[dict]]) -> None:
        self.name, self.rounds, self.metric = name, rounds, metric
        self.client_rows = client_rows
        self.shown = interactive()
        self.rounds_bar = self._bar(total=rounds, initial=start_round - 1, desc=f"{name} rounds", unit="round")
        self.steps_bar: tqdm | None = None  # from the first round's clients on
        self.eval_bar: tqdm | None = None
        self.round = 0
        self.remaining: dict[int, int] = {}  # steps each client of the round has yet to report
        self.lock = threading.Lock()  # split clients' messages may arrive from transport threads

    def _bar(self, **kwargs: Any) -> tqdm:
        return tqdm(disable=not self.shown, dynamic_ncols=True, **kwargs)

    def clients_started(self, round_idx: int, jobs: list[ClientJob]) -> None:
        """Clients start training (again, on a retried attempt): their steps join the round's total."""
        steps = {job.client_id: local_steps(len(self.client_rows[job.client_id]), job.settings) for job in jobs}
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

    def client_step(self, client_id: int) -> None:
        with self.lock:
            self.remaining[client_id] = self.remaining.get(client_id, 0) - 1
            if self.steps_bar is not None:
                self.steps_bar.set_postfix_str(f"client {client_id}", refresh=False)
                self.steps_bar.update(1)

    def client_done(self, client_id: int) -> None:
        """``client_id`` finished (or failed): its steps not heard of one by one count now."""
        with self.lock:
            left = self.remaining.pop(client_id, 0)
            if left > 0 and self.steps_bar is not None:
                self.steps_bar.update(left)

    def evaluation_started(self, round_idx: int) -> None:
        """A bar over the evaluation's batches, shown once it runs long."""
        self.eval_bar = self._bar(total=0, desc=f"round {round_idx} evaluation", unit="batch", leave=False,
                                  delay=EVAL_BAR_DELAY_S)

    def evaluation_batch(self, done: int, batches: int) -> None:
        """``Task.evaluate``'s callback: batch ``done`` of ``batches`` scored (one data set of the evaluation)."""
        if self.eval_bar is None:
            return
        if done == 1:
            self.eval_bar.total += batches
        self.eval_bar.update(1)

    def evaluation_done(self) -> None:
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def round_done(self, record: RoundRecord) -> None:
        """Advance the rounds bar and write the round's line."""
        scores = {k: f"{v:.4f}" for k, v in record.scores.items()
                  if k.startswith(("test_", "local_")) and self.metric in k and not k.endswith("by_client")}
        loss = f"{record.train_loss:.4f}"
        self.rounds_bar.update(1)
        self.rounds_bar.set_postfix(scores | {"loss": loss})
        shown = "".join(f" {k}={v}" for k, v in scores.items())
        say(f"[{self.name}] round {record.round}/{self.rounds} train_loss={loss}{shown} wall={record.wall_s:.1f}s")

    def close(self) -> None:
        if self.steps_bar is not None:
            self.steps_bar.close()
        self.rounds_bar.close()
