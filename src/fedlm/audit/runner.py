"""`fedlm audit RUN_DIR`: attack a finished run as an honest-but-curious server, write audit.md + audit.json.

Split runs get the activation-inversion attack and the boundary-message checks; every run that uploads
parameters (FedAvg family, split runs sharing client parts) gets the update-leakage attack on the embedding
rows and the upload checks. A run with nothing sent to a server is refused in one line."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedlm.audit.activation_audit import InversionSettings, activation_audit
from fedlm.audit.boundary import read_public_text
from fedlm.audit.exposure import boundary_violations
from fedlm.audit.replay import replay_round
from fedlm.audit.report import write_audit
from fedlm.audit.scores import require_sacrebleu
from fedlm.audit.target import load_target
from fedlm.audit.update_leakage import embedding_name, fed_tokens, leakage, summarise, tied_to_output
from fedlm.config import ExperimentConfig
from fedlm.errors import UserError

log = logging.getLogger("fedlm")


def audit_run(run_dir: Path, data_dir: Path, *, public_text: Path | None = None,
              clients: Sequence[int] | None = None, inversion: InversionSettings | None = None,
              tol: float = 0.0) -> dict[str, Any]:
    """Audit one run directory; returns what audit.json holds. ``public_text`` defaults to wikitext-2's
    training text under ``data_dir``; ``clients`` to every client (at most 8)."""
    target = load_target(run_dir, data_dir)
    config = target.config
    n_clients = config.num_clients()
    client_ids = list(clients) if clients is not None else list(range(min(n_clients, 8)))
    bad = [c for c in client_ids if not 0 <= c < n_clients]
    if bad:
        raise UserError(f"--clients {bad}: this run has clients 0..{n_clients - 1}")
    inversion = inversion or InversionSettings()
    public_path = public_text or data_dir / "wikitext-2" / "train.txt"
    result: dict[str, Any] = {"run": config.name, "protocol": describe_protocol(config),
                              "public_text": str(public_path), "clients": client_ids}
    if config.split is not None:
        require_sacrebleu()  # before any training: the inversion's scores need it
        texts = read_public_text(public_path, inversion.public_sequences)
        result["activation_inversion"] = activation_audit(target, texts, client_ids, inversion)
    log.info("audit: recomputing round %d of clients %s", target.round + 1, client_ids)
    replay = replay_round(target, client_ids)
    result["round"] = replay.round
    embedding = embedding_name(target.prep.model)
    rows = [leakage(upload, embedding, fed_tokens(target.prep.client_train[upload.client_id]), tol)
            for upload in replay.uploads]
    result["update_leakage"] = {"embedding": embedding, "tied_to_output": tied_to_output(target.prep.model),
                                "codec": config.protocol.codec, "tolerance": tol, "clients": rows,
                                **summarise(rows)}
    violations = list(replay.violations) + boundary_violations(replay.messages)
    if "activation_inversion" in result:
        violations += result["activation_inversion"].pop("violations")
    received = {"uploads": sorted({n for u in replay.uploads for n in u.received})}
    if config.split is not None:
        received["boundary_messages"] = replay.messages.count
        received["boundary"] = replay.messages.as_dict()
    result["exposure"] = {"violations": violations, "received": received}
    result["failures"] = {str(c): why for c, why in replay.failures.items()}
    write_audit(run_dir, result)
    return result


def describe_protocol(config: ExperimentConfig) -> str:
    """'fedavg', or 'split cut (0, 0), client_parts average, fedavg' for a split run."""
    split = config.split
    if split is None:
        return config.protocol.kind
    return (f"split cut ({split.bottom_blocks}, {split.top_blocks}), client_parts {split.client_parts}, "
            f"{config.protocol.kind}")
