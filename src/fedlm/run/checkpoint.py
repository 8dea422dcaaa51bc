"""Checkpoints a run resumes from: written in one atomic step, and checked against the run before it continues.

A checkpoint is one file, ``checkpoint/state.pt``: the global parameters, the server strategy's state, the
clients' local states (or, for the disk store, which version of each client's file belongs to it), and the
fingerprint of the training-relevant part of the config it was trained with. Resuming refuses, in one line,
a checkpoint from another config (another run's, or a config.yaml changed since), from an older format, or
whose client states do not fit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedlm.config import ExperimentConfig
from fedlm.errors import UserError
from fedlm.federation.params import NamedTensors
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies import Strategy
from fedlm.run.recorder import RunRecorder

FORMAT = 2  # 2: client states inside the checkpoint, the config's fingerprint beside them

# Keys that may differ between a run and its continuation: they do not change what the rounds train (names,
# where results go, trackers, checkpoint spacing, how many rounds, where it computes, what is evaluated and
# reported, what runs after it).
NOT_TRAINING = ("name", "tags", "output_dir", "report_to", "checkpoint_every", "eval", "grid", "baselines",
                "downstream", "protocol.rounds", "train.device")


def training_part(config: ExperimentConfig) -> dict[str, Any]:
    """The resolved config without the keys a continuation may change (``NOT_TRAINING``), flattened to dotted
    keys."""
    flat = _flatten(config.model_dump(mode="json"))
    return {k: v for k, v in flat.items() if not any(k == n or k.startswith(n + ".") for n in NOT_TRAINING)}


def fingerprint(config: ExperimentConfig) -> str:
    """A hash of ``training_part``: equal configs train equal rounds."""
    return hashlib.sha256(json.dumps(training_part(config), sort_keys=True).encode()).hexdigest()


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass
class Checkpoint:
    """What ``checkpoint/state.pt`` holds, as the run wrote it after round ``round``."""

    round: int
    global_params: NamedTensors
    strategy: dict[str, Any]  # the strategy's state_dict (FedOpt's moments, the DP ledger)
    clients: dict[str, Any]  # the client store's part (``ClientStore.checkpoint``)
    fingerprint: str
    training_config: dict[str, Any]
    format: int = FORMAT

    def to_state(self) -> dict[str, Any]:
        """The file's contents (its keys are the format every fedlm since format 2 reads)."""
        return {"round": self.round, "global": self.global_params, "strategy": self.strategy, "clients": self.clients,
                "format": self.format, "fingerprint": self.fingerprint, "training_config": self.training_config}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Checkpoint:
        return cls(round=int(state["round"]), global_params=dict(state["global"]), strategy=state["strategy"],
                   clients=state["clients"], fingerprint=state["fingerprint"],
                   training_config=state["training_config"], format=state["format"])


def checkpointer(recorder: RunRecorder, store: ClientStore, strategy: Strategy,
                 config: ExperimentConfig) -> Callable[[int, NamedTensors], None]:
    """The engine's checkpoint hook. The store prepares its part (the disk store renames the round's files
    beside the last checkpoint's), the one file is replaced atomically, and only then may the store drop
    what the previous checkpoint needed: a crash at any point leaves one whole, consistent checkpoint."""
    stamp, training = fingerprint(config), training_part(config)

    def save(round_idx: int, params: NamedTensors) -> None:
        saved = Checkpoint(round_idx, params, strategy.state_dict(), store.checkpoint(round_idx), stamp, training)
        recorder.save_checkpoint(saved.to_state())
        store.checkpointed(round_idx)

    return save


def load_checkpoint(recorder: RunRecorder, config: ExperimentConfig) -> Checkpoint | None:
    """The run's last checkpoint if it was trained with ``config`` (its training-relevant part); None if
    there is none. Anything else stops with one line: resuming it would continue a different run."""
    state = recorder.load_checkpoint()
    if state is None:
        return None
    path = recorder.checkpoint_path
    if state.get("format") != FORMAT:
        raise UserError(f"{path} was written by an older fedlm, whose checkpoints are not crash-safe: it cannot "
                        "be resumed; start the run afresh (fedlm run ... --overwrite)")
    saved, current = Checkpoint.from_state(state), training_part(config)
    if saved.fingerprint != fingerprint(config) and _read_today(saved.training_config, config) != current:
        raise UserError(f"{path} (round {saved.round}) was trained with another config "
                        f"({_differences(saved.training_config, current)}): it belongs to "
                        "another run or the run's config changed; restore that config, or start afresh "
                        "(fedlm run ... --overwrite)")
    return saved


def _read_today(saved: dict[str, Any], config: ExperimentConfig) -> dict[str, Any] | None:
    """A checkpoint's training config read through today's schema, so a key fedlm added since it was written
    counts as its default (the value the run trained with) rather than as a change; None if it no longer
    validates. The keys a continuation may change are taken from ``config``."""
    training = training_part(config)
    continuation = {k: v for k, v in _flatten(config.model_dump(mode="json")).items() if k not in training}
    tree: dict[str, Any] = {}
    for key, value in {**continuation, **saved}.items():
        *parents, leaf = key.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                return None
        node[leaf] = value
    try:
        return training_part(type(config).model_validate(tree))
    except ValueError:
        return None


def _differences(saved: dict[str, Any], current: dict[str, Any], shown: int = 3) -> str:
    """'train.lr 0.003 -> 0.01, ...' for the first few keys that differ."""
    keys = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    listed = [f"{k} {saved.get(k)!r} -> {current.get(k)!r}" for k in keys[:shown]]
    return ", ".join(listed) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")
