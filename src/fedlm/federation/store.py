"""Each client's local (never-sent) parameters between rounds: in memory, or one file per client on disk.

A run resumed from round k must see exactly the local states of round k, never those of a round after it.
So the store is never committed on its own: ``checkpoint(k)`` hands back what the run's checkpoint file
must hold (the memory store: the states themselves; the disk store: which version of each client's file
belongs to round k), the checkpoint is written in one atomic step, and only then ``checkpointed(k)`` drops
older versions. ``restore`` takes a checkpoint's part back and refuses one that does not fit this run;
``read_client_state`` reads one client's state from such a part without changing anything.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from fedlm.errors import UserError
from fedlm.federation.durable import fsync_dir, save_atomic
from fedlm.federation.params import NamedTensors, nbytes

log = logging.getLogger("fedlm")


class ClientStore:
    """Each client's local parameters in memory; a checkpoint carries all of them in its one file."""

    kind = "memory"

    def __init__(self, initial: NamedTensors) -> None:
        self.initial = initial
        self.states: dict[int, NamedTensors] = {}

    def get(self, client_id: int) -> NamedTensors:
        return self.states.get(client_id, self.initial)

    def put(self, client_id: int, state: NamedTensors) -> None:
        if state:
            self.states[client_id] = state

    def checkpoint(self, round_idx: int) -> dict[str, Any]:
        """What the round-``round_idx`` checkpoint holds of the clients (written by the caller, atomically)."""
        return {"kind": self.kind, "round": round_idx, "states": dict(self.states)}

    def checkpointed(self, round_idx: int) -> None:
        """The checkpoint of ``round_idx`` is on disk: what only older checkpoints needed may go."""

    def portable(self, round_idx: int) -> dict[str, Any]:
        """Every client's state as the memory store's checkpoint part of ``round_idx`` holds it: what another
        process of the run (``fedlm run --workers``, maybe on another machine) restores into memory."""
        return {"kind": ClientStore.kind, "round": round_idx, "states": self._states()}

    def _states(self) -> dict[int, NamedTensors]:
        return dict(self.states)

    def restore(self, saved: dict[str, Any], round_idx: int) -> None:
        """The clients' states of the checkpoint of ``round_idx``; a part that does not fit is refused."""
        self._check(saved, round_idx)
        for client_id, state in saved["states"].items():
            if set(state) != set(self.initial):
                raise UserError(f"the checkpoint's local parameters of client {client_id} are not the ones this "
                                f"run keeps local ({len(state)} vs {len(self.initial)} tensors); the checkpoint "
                                "belongs to another run: start afresh (fedlm run ... --overwrite)")
        self.states = dict(saved["states"])

    def _check(self, saved: dict[str, Any], round_idx: int) -> None:
        if saved.get("kind") != self.kind or saved.get("round") != round_idx:
            raise UserError(f"the checkpoint of round {round_idx} holds the clients' local states of round "
                            f"{saved.get('round')} kept in {saved.get('kind')}, but this run keeps them in "
                            f"{self.kind}: the checkpoint does not fit this run; start it afresh "
                            "(fedlm run ... --overwrite)")


STATES_DIR = "client_states"  # where in a run directory the disk store keeps its files
_COMMITTED = "committed"  # the disk store's folder of checkpointed states, one <client>.r<version>.pt each
_VERSIONED = re.compile(r"(\d+)\.r(\d+)\.pt")


def _committed_file(directory: Path, client_id: int, version: int) -> Path:
    """Where the disk store in ``directory`` keeps ``client_id``'s state of the checkpoint of round ``version``."""
    return directory / _COMMITTED / f"{client_id}.r{version}.pt"


class DiskClientStore(ClientStore):
    """The same contract with one file per client, for populations whose local parts do not fit in memory.

    A round's writes go to ``pending/<client>.pt``; ``checkpoint(k)`` renames them to
    ``committed/<client>.r<k>.pt`` beside the versions the last checkpoint names, so that checkpoint stays
    whole until the new one replaces it. ``restore`` keeps exactly the versions its checkpoint names and
    refuses one whose files are missing. Only the clients touched in a round are ever in memory.
    """

    kind = "disk"

    def __init__(self, initial: NamedTensors, directory: Path) -> None:
        super().__init__(initial)
        self.directory = directory
        self.pending = directory / "pending"
        self.committed = directory / _COMMITTED
        self.pending.mkdir(parents=True, exist_ok=True)
        self.committed.mkdir(parents=True, exist_ok=True)
        self.versions: dict[int, int] = {}  # client -> round of its committed file
        for path in self.pending.glob("*"):  # an earlier process's uncommitted writes
            path.unlink()

    def _file(self, client_id: int, version: int) -> Path:
        return _committed_file(self.directory, client_id, version)

    def get(self, client_id: int) -> NamedTensors:
        pending = self.pending / f"{client_id}.pt"
        if pending.is_file():
            return torch.load(pending, weights_only=True)
        if client_id in self.versions:
            return torch.load(self._file(client_id, self.versions[client_id]), weights_only=True)
        return self.initial

    def put(self, client_id: int, state: NamedTensors) -> None:
        if state:
            save_atomic(state, self.pending / f"{client_id}.pt")

    def checkpoint(self, round_idx: int) -> dict[str, Any]:
        versions = dict(self.versions)
        for path in sorted(self.pending.glob("*.pt")):
            client_id = int(path.stem)
            os.replace(path, self._file(client_id, round_idx))
            versions[client_id] = round_idx
        fsync_dir(self.committed)
        self.versions = versions
        return {"kind": self.kind, "round": round_idx, "versions": dict(versions)}

    def checkpointed(self, round_idx: int) -> None:
        self._prune()

    def _states(self) -> dict[int, NamedTensors]:
        return {client_id: self.get(client_id) for client_id in sorted(self.versions)}

    def restore(self, saved: dict[str, Any], round_idx: int) -> None:
        self._check(saved, round_idx)
        versions = {int(c): int(v) for c, v in saved["versions"].items()}
        for client_id, version in sorted(versions.items()):
            if version > round_idx or not self._file(client_id, version).is_file():
                raise UserError(f"the checkpoint of round {round_idx} needs client {client_id}'s local state "
                                f"{self._file(client_id, version)}, which is missing: the run cannot resume "
                                "consistently; start it afresh (fedlm run ... --overwrite)")
        self.versions = versions
        self._prune()

    def _prune(self) -> None:
        """Drop every committed file the current versions do not name (older ones, or a torn checkpoint's)."""
        for path in self.committed.glob("*"):
            match = _VERSIONED.fullmatch(path.name)
            if match is None or self.versions.get(int(match[1])) != int(match[2]):
                path.unlink()


def read_client_state(saved: dict[str, Any], round_idx: int, client_id: int, initial: NamedTensors,
                      directory: Path) -> NamedTensors:
    """One client's local state as the checkpoint of ``round_idx`` holds it in ``saved`` (what a store's
    ``checkpoint`` returned), ``initial`` for a client that has none, read without writing, moving or pruning
    any file: the memory store's part holds the states (refused as ``restore`` refuses it when it does not fit);
    the disk store's names the version of the client's file in ``directory``, the disk store's directory."""
    if saved.get("kind") == DiskClientStore.kind:
        versions = saved["versions"]
        version = versions.get(client_id, versions.get(str(client_id)))
        if version is None:
            return initial
        return torch.load(_committed_file(directory, client_id, version), weights_only=True)
    store = ClientStore(initial)
    store.restore(saved, round_idx)
    return store.get(client_id)


def make_client_store(initial: NamedTensors, num_clients: int, where: str, disk_dir: Path,
                      memory_budget: int = 2 * 1024**3) -> ClientStore:
    """Memory while every client's local part fits in ``memory_budget`` bytes (or if asked), disk otherwise."""
    needed = nbytes(initial) * num_clients
    if where == "disk" or (where == "auto" and needed > memory_budget):
        log.info("client local states on disk (%d clients x %.1f MB)", num_clients, nbytes(initial) / 1e6)
        return DiskClientStore(initial, disk_dir)
    return ClientStore(initial)
