"""One round of each audited client, recomputed from the run's checkpoint and partition: what the server
received from it (its upload, decoded through the run's codec) and, for split runs, every boundary message
(through the executor's message hook). Clients train exactly as the run's next round would train them
(their seeds, settings and frozen parameters); nothing is written to the run."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fedlm.audit.exposure import MessageLog, upload_violations
from fedlm.audit.target import AuditTarget
from fedlm.audit.update_leakage import Upload
from fedlm.federation.client_round import fit_client
from fedlm.federation.codecs import Codec, Encoded
from fedlm.federation.engine import round_settings
from fedlm.federation.executor import ClientJob, ClientReport
from fedlm.federation.local_training import LocalSettings, local_seed
from fedlm.federation.params import NamedTensors, load_into
from fedlm.federation.store import ClientStore
from fedlm.federation.strategies.base import sample_clients
from fedlm.run.single import round_plan, run_codec, run_strategy
from fedlm.split.executor import SplitExecutor
from fedlm.split.setup import SplitSetup


@dataclass
class Replay:
    """The round's uploads, the clients that failed (with why), and what crossed to the server."""

    round: int
    uploads: list[Upload] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    messages: MessageLog = field(default_factory=MessageLog)


def replay_round(target: AuditTarget, client_ids: Sequence[int]) -> Replay:
    """Recompute the round after the checkpoint (round 1 from the start without one) for ``client_ids``."""
    config = target.config
    round_idx = target.round + 1
    codec = run_codec(config.protocol)
    global_params = target.global_params()
    plan = round_plan(config, config.num_clients())
    # as the engine builds them: a sample-level DP run's clients train by DP-SGD, so their uploads are noised
    settings = round_settings(LocalSettings.from_config(config.train), run_strategy(target.prep, plan), plan,
                              round_idx)
    sampled = sample_clients(list(range(config.num_clients())), plan.clients_per_round, config.seed, round_idx)
    model = copy.deepcopy(target.prep.model)  # the public model stays as it was built
    load_into(model, global_params)
    replay = Replay(round_idx)
    if config.split is None:
        _fedavg(target, model, client_ids, codec, global_params, settings, sampled, replay)
    else:
        _split(target, model, client_ids, codec, global_params, settings, replay)
    return replay


def _job(target: AuditTarget, cid: int, round_idx: int, sent: Encoded, settings: LocalSettings,
         frozen: tuple[str, ...] = ()) -> ClientJob:
    return ClientJob(cid, round_idx, sent, settings, local_seed(target.config.seed, round_idx, cid), None, frozen)


def _fedavg(target: AuditTarget, model: torch.nn.Module, client_ids: Sequence[int], codec: Codec,
            global_params: NamedTensors, settings: LocalSettings, sampled: list[int], replay: Replay) -> None:
    sent = codec.encode(global_params)
    decoded_sent = codec.decode(sent)
    names = {n for n, _ in model.named_parameters()}
    for cid in client_ids:
        job = _job(target, cid, replay.round, sent, settings, target.policy.frozen_for(replay.round, sampled, cid))
        try:
            report, _local = fit_client(model, target.prep.task, target.prep.client_train[cid], job, codec,
                                        target.client_state(cid), target.policy.local_names)
        except Exception as exc:  # a client whose round fails sends nothing to audit
            replay.failures[cid] = f"{type(exc).__name__}: {exc}"
            continue
        replay.violations += upload_violations(report.update.params, names, report.update.metrics)
        replay.uploads.append(Upload(cid, decoded_sent, dict(report.update.params)))


def _split(target: AuditTarget, model: torch.nn.Module, client_ids: Sequence[int], codec: Codec,
           global_params: NamedTensors, settings: LocalSettings, replay: Replay) -> None:
    """Each client's turn alone against the checkpoint's trunk, through the in-process transport (the same
    serialisation and checks as gRPC), so the hook sees every message as the server decodes it."""
    spec = target.config.split.model_copy(update={"transport": "inprocess"})
    store = ClientStore({n: target.public[n] for n in target.policy.local_names})
    for cid in client_ids:
        store.put(cid, target.client_state(cid))
    rows = {cid: target.prep.client_train[cid] for cid in client_ids}
    setup = SplitSetup.cut(model, spec)
    executor = SplitExecutor(model, spec, target.prep.task, rows, codec, store, settings, hook=replay.messages,
                             max_length=target.config.model.max_length, setup=setup)
    sent = codec.encode(executor.downlink(global_params))
    decoded_sent = codec.decode(sent)
    names = {n for n, _ in model.named_parameters()}
    try:
        for cid in client_ids:
            executor.begin_round(replay.round, global_params)
            (result,) = executor.run([_job(target, cid, replay.round, sent, settings)])
            if not isinstance(result, ClientReport):
                replay.failures[cid] = result.reason
                continue
            # what left the client: its report's shared parts, or (share) the parts the server relays on
            received = {**result.update.params, **executor.parts_policy.server_params()}
            received = {n: received[n] for n in setup.parts.shared if n in received}
            replay.violations += upload_violations(received, names, result.update.metrics)
            replay.uploads.append(Upload(cid, decoded_sent, received))
    finally:
        executor.close()
