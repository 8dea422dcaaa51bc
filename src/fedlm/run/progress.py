"""What a run shows while it works: bars on a terminal, one line per round in a log or pipe."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


def interactive() -> bool:
    return sys.stderr.isatty()


class RoundProgress:
    """A bar over rounds and one over the clients of the current round (terminal), or a line per round."""

    def __init__(self, name: str, rounds: int, start_round: int, clients_per_round: int, metric: str) -> None:
        self.name, self.rounds, self.metric = name, rounds, metric
        shown = interactive()
        self.bar = tqdm(total=rounds, initial=start_round - 1, desc=f"{name} rounds", unit="round",
                        disable=not shown, dynamic_ncols=True)
        self.clients = tqdm(total=clients_per_round, desc="clients", leave=False, unit="client",
                            disable=not shown, dynamic_ncols=True)

    def client_done(self, client_id: int) -> None:
        del client_id
        self.clients.update(1)

    def round_done(self, round_idx: int, record: dict[str, Any]) -> None:
        self.clients.reset()
        self.bar.update(1)
        headline = {k: v for k, v in record.items() if k.startswith(("test_", "local_")) and self.metric in k
                    and not k.endswith("by_client")}
        self.bar.set_postfix({k: f"{v:.4f}" for k, v in headline.items()} | {"loss": f"{record['train_loss']:.4f}"})
        if not interactive():
            shown = " ".join(f"{k}={v:.4f}" for k, v in headline.items())
            print(f"[{self.name}] round {round_idx}/{self.rounds} train_loss={record['train_loss']:.4f} "
                  f"{shown} wall={record['wall_s']:.1f}s", flush=True)

    def close(self) -> None:
        self.bar.close()
        self.clients.close()
