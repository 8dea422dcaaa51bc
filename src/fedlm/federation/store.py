"""Each client's local (never-sent) parameters between rounds: in memory, or one file per client on disk.

Writes during a round stay pending until ``commit`` (called at checkpoints), so a run resumed from round k
sees exactly the local states of round k.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fedlm.federation.params import NamedTensors, nbytes

log = logging.getLogger("fedlm")


class ClientStore:
    """Each client's local (never-sent) parameters, in memory, committed to one file at checkpoints.

    Writes during a round stay pending until ``commit`` so that a run resumed from round k sees exactly the
    local states of round k, even if it was interrupted halfway through round k+1.
    """

    def __init__(self, initial: NamedTensors, path: Path) -> None:
        self.initial = initial
        self.path = path
        self.states: dict[int, NamedTensors] = {}

    def get(self, client_id: int) -> NamedTensors:
        return self.states.get(client_id, self.initial)

    def put(self, client_id: int, state: NamedTensors) -> None:
        if state:
            self.states[client_id] = state

    def commit(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save(self.states, tmp)
        tmp.replace(self.path)

    def restore(self) -> None:
        if self.path.is_file():
            self.states = torch.load(self.path, weights_only=True)


class DiskClientStore(ClientStore):
    """The same contract with one file per client, for populations whose local parts do not fit in memory.

    A round's writes go to ``pending/``; ``commit`` moves them into ``committed/``, ``restore`` discards
    whatever an interrupted round left pending. Only the clients touched in a round are ever in memory.
    """

    def __init__(self, initial: NamedTensors, directory: Path) -> None:
        super().__init__(initial, directory)
        self.pending = directory / "pending"
        self.committed = directory / "committed"
        self.pending.mkdir(parents=True, exist_ok=True)
        self.committed.mkdir(parents=True, exist_ok=True)

    def get(self, client_id: int) -> NamedTensors:
        for folder in (self.pending, self.committed):
            path = folder / f"{client_id}.pt"
            if path.is_file():
                return torch.load(path, weights_only=True)
        return self.initial

    def put(self, client_id: int, state: NamedTensors) -> None:
        if state:
            tmp = self.pending / f"{client_id}.tmp"
            torch.save(state, tmp)
            tmp.replace(self.pending / f"{client_id}.pt")

    def commit(self) -> None:
        for path in self.pending.glob("*.pt"):
            path.replace(self.committed / path.name)

    def restore(self) -> None:
        for path in self.pending.glob("*"):
            path.unlink()


def make_client_store(initial: NamedTensors, num_clients: int, where: str, memory_path: Path, disk_dir: Path,
                      memory_budget: int = 2 * 1024**3) -> ClientStore:
    """Memory while every client's local part fits in ``memory_budget`` bytes (or if asked), disk otherwise."""
    needed = nbytes(initial) * num_clients
    if where == "disk" or (where == "auto" and needed > memory_budget):
        log.info("client local states on disk (%d clients x %.1f MB)", num_clients, nbytes(initial) / 1e6)
        return DiskClientStore(initial, disk_dir)
    return ClientStore(initial, memory_path)
