"""A finished run as the audit sees it: its config, the prepared data and model (the public starting
weights, rebuilt from the config and seed exactly as the run built them), and its last checkpoint. The
audit only reads the run directory; it writes nothing but its own two files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fedlm.config import ExperimentConfig
from fedlm.errors import UserError
from fedlm.federation.params import NamedTensors, snapshot
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.store import STATES_DIR, read_client_state
from fedlm.run.checkpoint import Checkpoint, load_checkpoint
from fedlm.run.policy import run_policy
from fedlm.run.prepare import Prepared, prepare
from fedlm.run.recorder import RunRecorder
from fedlm.run.rundir import read_written_config


@dataclass
class AuditTarget:
    """One run to attack: ``public`` is every parameter at the run's start, ``checkpoint`` its last state."""

    run_dir: Path
    config: ExperimentConfig
    prep: Prepared
    policy: SharingPolicy
    public: NamedTensors
    checkpoint: Checkpoint | None

    @property
    def round(self) -> int:
        """The round the checkpoint closed (0: no checkpoint, the starting point)."""
        return self.checkpoint.round if self.checkpoint is not None else 0

    def global_params(self) -> NamedTensors:
        """The global parameters after the checkpoint's round (the start's without one)."""
        if self.checkpoint is None:
            return {n: self.public[n] for n in self.policy.global_names}
        return dict(self.checkpoint.global_params)

    def client_state(self, client_id: int) -> NamedTensors:
        """A client's kept parameters at the checkpoint, read without touching the run's files."""
        initial = {n: self.public[n] for n in self.policy.local_names}
        if self.checkpoint is None or not initial:
            return initial
        # read-only: a store's restore would prune the disk store's files
        return read_client_state(self.checkpoint.clients, self.round, client_id, initial,
                                 self.run_dir / STATES_DIR)

    def trained(self, client_id: int) -> NamedTensors:
        """Everything a client's model held at the checkpoint: the global part and its own."""
        return {**self.global_params(), **self.client_state(client_id)}


def cannot_audit(config: ExperimentConfig) -> str | None:
    """Why a run has nothing for an honest-but-curious server to attack, or None."""
    kind = config.protocol.traits
    if kind.pools_data:
        return (f"a {kind.name} run pools the raw text on one machine: the server holds the data itself, there "
                "is no message to audit")
    if kind.shares_nothing:
        return f"an {kind.name} run sends nothing to a server: there is no message to audit"
    return None


def load_target(run_dir: Path, data_dir: Path) -> AuditTarget:
    """Rebuild a finished run's model and data from its directory; refuses a directory that holds no run."""
    if (run_dir / "grid.yaml").is_file():
        raise UserError(f"{run_dir} holds a grid of runs; audit one of its run directories")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} holds no run (no config.yaml there); give a directory that fedlm run wrote")
    config = read_written_config(run_dir / "config.yaml")
    reason = cannot_audit(config)
    if reason is not None:
        raise UserError(f"cannot audit {run_dir}: {reason}")
    checkpoint = load_checkpoint(RunRecorder(run_dir), config)
    torch.manual_seed(config.seed)  # as run_single seeds before it prepares: the same starting weights
    prep = prepare(config, data_dir, cache_dir=Path(config.output_dir) / ".cache")
    policy = run_policy(prep)
    public = snapshot(prep.model)
    return AuditTarget(run_dir, config, prep, policy, public, checkpoint)
