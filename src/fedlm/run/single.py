"""One run, start to finish: prepare, pick the policy and executor, drive the round engine, save and summarise.

``run_single`` reads as the steps it takes; each step is a small function here or a module of its own
(prepare, policy, placement, evaluate, progress, tracking, downstream, recorder, report).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedlm.config import ExperimentConfig, ProtocolConfig
from fedlm.data.partition_stats import write_partition_report
from fedlm.errors import RunStopped, UserError
from fedlm.federation.codecs import Codec, get_codec
from fedlm.federation.collective import Collective
from fedlm.federation.dp_sgd import refuse_unsupported
from fedlm.federation.engine import EngineHooks, RoundEngine, RoundFailed, RoundPlan
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import NamedTensors, load_into, snapshot
from fedlm.federation.privacy import PrivacySpec, with_privacy
from fedlm.federation.records import FailedRound, RoundRecord
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.store import STATES_DIR, ClientStore, make_client_store
from fedlm.federation.strategies import Strategy, build_strategy, rule_minimum
from fedlm.models.device import model_device
from fedlm.run.checkpoint import Checkpoint, checkpointer, load_checkpoint
from fedlm.run.downstream import run_downstream
from fedlm.run.environment import changed_line, describe, record_environment
from fedlm.run.evaluate import Evaluator
from fedlm.run.lock import run_lock
from fedlm.run.placement import Placement, RunClients, Simulation
from fedlm.run.policy import describe_policy, encoder_is_global, run_policy
from fedlm.run.prepare import Prepared, num_clients_of, partition_labels, prepare
from fedlm.run.progress import RoundProgress, announce
from fedlm.run.recorder import RunRecorder
from fedlm.run.report import markdown_table, plot_run, summarize
from fedlm.run.rundir import clear_run, config_text, refuse_existing
from fedlm.run.selection import BestOnValidation
from fedlm.run.tracking import Trackers, open_trackers
from fedlm.tasks import Task

log = logging.getLogger("fedlm")

SIMULATION = Simulation()  # every client in this process


def run_single(config: ExperimentConfig, data_dir: Path, run_dir: Path, *, resume: bool = False,
               overwrite: bool = False, placement: Placement = SIMULATION) -> dict[str, Any]:
    """Run (or resume) one experiment into ``run_dir``; returns its summary row. A new run refuses a directory
    holding a run unless ``overwrite``, and replaces it only once its config, data and model have loaded.
    ``placement`` says where the clients run (this process by default; Flower's ServerApp passes its own;
    ``Sharded`` spreads them over the processes of its collective, of which this one writes the run). The
    run directory is this process's alone while it runs (``run_lock``)."""
    if not resume:
        refuse_existing(run_dir, overwrite)  # before anything is written
    trackers = open_trackers(config, run_dir, resume)  # a missing tracker package stops the run here
    try:
        with run_lock(run_dir):
            if not resume:
                refuse_existing(run_dir, overwrite)  # again, now that no other process can write it
            return _run_locked(config, data_dir, run_dir, resume, overwrite, placement, trackers)
    finally:
        trackers.close()


def _run_locked(config: ExperimentConfig, data_dir: Path, run_dir: Path, resume: bool, overwrite: bool,
                placement: Placement, trackers: Trackers) -> dict[str, Any]:
    collective = placement.collective
    recorder = RunRecorder(run_dir)
    checkpoint = load_checkpoint(recorder, config) if resume else None  # another config's: refused here
    n_clients = num_clients_of(config)
    plan = round_plan(config, n_clients)
    announce(config.name, config.protocol.kind, plan, n_clients,
             checkpoint.round + 1 if checkpoint is not None else 1, run_dir)
    if collective.world > plan.clients_per_round:
        log.warning("%s: %d workers for %d clients per round: %d of them stay idle in every round", config.name,
                    collective.world, plan.clients_per_round, collective.world - plan.clients_per_round)
    collective.broadcast(config)  # the run's other processes prepare beside this one
    prep = prepare_run(config, data_dir)
    policy = run_policy(prep)
    if config.privacy.kind == "sample":  # the task is known only now; refused before the run directory is touched
        refuse_unsupported(config.model.family, prep.task_name)
    if config.eval.select == "best" and policy.personalized:  # likewise known only now
        raise UserError("eval.select: best picks one global model by its validation score, and this run's clients "
                        "keep parameters of their own (sharing, client_parts local or a critical layer); set "
                        "eval.select: last")
    if checkpoint is None:  # a new run (or nothing was checkpointed): it starts over, its starting point included
        if overwrite and not resume:
            clear_run(run_dir)  # only now: config, data and model have loaded
        recorder.start_afresh(config_text(config))
    start = start_run(prep, plan, policy, checkpoint, collective, lambda local: make_client_store(
        local, n_clients, config.sharing.local_store, run_dir / STATES_DIR))
    if checkpoint is not None:
        if config.split is not None and config.split.optimizer_state == "carry":
            log.warning("%s: split.optimizer_state carry: checkpoints hold no optimizer state, so the resumed "
                        "rounds start the trunk's and the client parts' optimizers afresh", config.name)
        recorder.truncate_after(checkpoint.round)
    changed = record_environment(run_dir, start.round, describe(model_device(prep.model), collective.world))
    if changed:
        log.warning(changed_line(config.name, start.round, changed))
    record_inputs(recorder, prep)
    recorder.write_json("sharing.json", describe_policy(policy, prep.model))
    progress = RoundProgress(config.name, config.protocol.rounds, start.round, prep.task.target_metric()[0],
                             prep.client_train)
    settings = LocalSettings.from_config(config.train)
    store = start.store
    evaluator = Evaluator(prep, store, policy.personalized, on_batch=progress.evaluation_batch, collective=collective)
    selector = selection(config, prep, recorder)
    hooks = EngineHooks(evaluate=evaluator if selector is None else selector.watching(evaluator),
                        record=recording(recorder, trackers),
                        checkpoint=checkpointer(recorder, store, start.strategy, config))
    executor = placement.executor(RunClients(prep, policy, start.codec, store, settings, progress))
    engine = RoundEngine(strategy=start.strategy, executor=executor, codec=start.codec,
                         client_ids=list(range(n_clients)), settings=settings, plan=plan, hooks=hooks,
                         observer=progress, sharing=policy, collective=collective)
    try:
        final = engine.run(start.global_params, start_round=start.round)
    except RoundFailed as failed:
        if failed.lasting:
            raise RunStopped(f"{failed}. The run keeps its rounds before this one: run -v to see the traceback, "
                             "then change the model or setting that raises it (or report it as a bug)") from None
        raise RunStopped(f"{failed}. The run keeps its rounds before this one; fix the cause and continue with "
                         f"`fedlm run --resume {run_dir}`") from None
    finally:
        executor.close()
        progress.close()
    delivered = final if selector is None else selector.params(final)
    save_final_model(prep, delivered, store, run_dir / "model", policy.personalized, n_clients,
                     head_only=encoder_is_global(policy))
    return summarise(config, data_dir, recorder, prep.task, resume)


def selection(config: ExperimentConfig, prep: Prepared, recorder: RunRecorder) -> BestOnValidation | None:
    """eval.select: best's keeper of the best round's parameters (None: the run delivers its last round)."""
    if config.eval.select != "best":
        return None
    metric, direction = prep.task.target_metric()
    return BestOnValidation(recorder.run_dir / "checkpoint" / "best.safetensors", metric, direction,
                            recorder.records())


def prepare_run(config: ExperimentConfig, data_dir: Path) -> Prepared:
    """The run's data, task and model, from its seed (every process of a run prepares the same)."""
    torch.manual_seed(config.seed)
    return prepare(config, data_dir, cache_dir=Path(config.output_dir) / ".cache")


@dataclass
class RunStart:
    """Where the round loop starts: round ``round`` from these global parameters, strategy and client states."""

    round: int
    global_params: NamedTensors
    strategy: Strategy
    codec: Codec
    store: ClientStore


def start_run(prep: Prepared, plan: RoundPlan, policy: SharingPolicy, checkpoint: Checkpoint | None,
              collective: Collective, make_store: Callable[[NamedTensors], ClientStore]) -> RunStart:
    """The starting point: the prepared model, or the checkpoint a resume continues from. With several
    processes (``fedlm run --workers``) the leading one's model and checkpoint are handed to the others (which
    pass None), the clients' local states as the memory store holds them, so every process starts alike."""
    collective.broadcast_tensors(prep.model.state_dict().values())
    initial = snapshot(prep.model, policy.global_names + policy.local_names)
    store = make_store({n: initial[n] for n in policy.local_names})
    strategy = run_strategy(prep, plan)
    global_params = {n: initial[n] for n in policy.global_names}
    if checkpoint is not None:
        store.restore(checkpoint.clients, checkpoint.round)  # one that does not fit is refused here
    if collective.world > 1:
        checkpoint = collective.broadcast(None if checkpoint is None else dataclasses.replace(
            checkpoint, clients=store.portable(checkpoint.round)))
        if checkpoint is not None and not collective.leads:
            store.restore(checkpoint.clients, checkpoint.round)
    if checkpoint is None:
        return RunStart(1, global_params, strategy, run_codec(prep.config.protocol), store)
    strategy.load_state_dict(checkpoint.strategy)
    return RunStart(checkpoint.round + 1, checkpoint.global_params, strategy, run_codec(prep.config.protocol), store)


def record_inputs(recorder: RunRecorder, prep: Prepared) -> None:
    """data.json (source, task, split note, sizes) and the partition report, before any training."""
    config = prep.config
    recorder.write_json("data.json", {
        "source": config.data.source, "kind": prep.loaded.kind, "task": prep.task_name,
        "label_names": prep.loaded.label_names, "split_note": prep.loaded.split_note,
        "train_examples": len(prep.loaded.splits["train"]), "test_examples": len(prep.loaded.splits["test"]),
        **({"validation_examples": len(prep.validation_rows)} if prep.validation_rows else {}),
        "partition": config.partition.spec(), "client_sizes": prep.partition_sizes,
        **({"attackers": sorted(prep.attack.clients)} if prep.attack is not None else {}),
    })
    write_partition_report(recorder.run_dir / "partition", prep.train_partition, prep.train_input,
                           partition_labels(prep.loaded, "train")[1])


def run_strategy(prep: Prepared, plan: RoundPlan) -> Strategy:
    """The protocol's strategy inside the privacy section's kind (client-level noise, or DP-SGD's ledger)."""
    config = prep.config
    return with_privacy(build_strategy(config.protocol), PrivacySpec.from_config(config.privacy),
                        num_clients=num_clients_of(config), clients_per_round=plan.clients_per_round,
                        client_examples={cid: len(rows) for cid, rows in prep.client_train.items()},
                        batch_size=config.train.batch_size, seed=config.seed)


def run_codec(protocol: ProtocolConfig) -> Codec:
    """What crosses the wire: fp32 for centralized (nothing is sent), else the protocol's codec."""
    if not protocol.traits.has_wire:
        return get_codec("fp32")
    return get_codec(protocol.codec, protocol.codec_block_size)


def round_plan(config: ExperimentConfig, n_clients: int) -> RoundPlan:
    protocol = config.protocol
    per_round = n_clients if not protocol.traits.samples_clients else (
        protocol.clients_per_round or max(1, round(protocol.fraction * n_clients)))
    needed = rule_minimum(protocol)  # a robust rule's fewest reports: a round with fewer counts as failed
    if per_round < needed or (protocol.aggregator == "krum" and protocol.krum_m > per_round - protocol.krum_f):
        raise UserError(f"protocol.aggregator krum with krum_f {protocol.krum_f} and krum_m {protocol.krum_m} needs "
                        f"at least {max(needed, protocol.krum_m + protocol.krum_f)} clients per round (n > 2f + 2, "
                        f"m <= n - f); this run samples {per_round}: lower krum_f / krum_m or sample more clients")
    return RoundPlan(rounds=protocol.rounds, clients_per_round=per_round,
                     min_clients=max(min(protocol.min_clients, per_round), needed), max_retries=protocol.max_retries,
                     timeout_s=protocol.client_timeout_s, max_update_growth=protocol.max_update_growth,
                     seed=config.seed,
                     count_bytes=protocol.traits.counts_bytes,
                     eval_every=config.eval.every, eval_start=config.eval.start,
                     checkpoint_every=config.checkpoint_every,
                     lr_schedule=config.train.lr_schedule)


def recording(recorder: RunRecorder, trackers: Trackers) -> Callable[[RoundRecord | FailedRound], None]:
    """The engine's record hook: each round's record into metrics.jsonl, then to the trackers (report_to)."""

    def record(round_record: RoundRecord | FailedRound) -> None:
        recorder.log_round(round_record)
        trackers.log(round_record.to_dict())

    return record


def save_final_model(prep: Prepared, final: NamedTensors, store: ClientStore, path: Path, personalized: bool,
                     n_clients: int, head_only: bool = False) -> None:
    """Save with save_pretrained so the result loads in plain transformers (personalized: one per client, <= 10;
    when clients keep only their heads, the shared encoder with client 0's head is also saved at ``path``)."""
    if personalized:
        for cid in range(min(n_clients, 10)):
            load_into(prep.model, final)
            load_into(prep.model, store.get(cid))
            save_pretrained(prep, path / f"client_{cid}")
        if not head_only:
            return
        load_into(prep.model, store.get(0))
    load_into(prep.model, final)
    save_pretrained(prep, path)


def save_pretrained(prep: Prepared, path: Path) -> None:
    """The model as it is now, with its tokenizer; with an adapter, the adapter (peft's save_pretrained)."""
    if prep.adapter is not None:
        prep.adapter.save(path)
    else:
        prep.model.save_pretrained(path)
    prep.tokenizer.save_pretrained(path)


def summarise(config: ExperimentConfig, data_dir: Path, recorder: RunRecorder, task: Task,
              resume: bool) -> dict[str, Any]:
    """Learning curves, the summary row (with downstream scores) and summary.md."""
    target, direction = task.target_metric()
    records = recorder.records()
    plot_run(records, target, recorder.run_dir, f"{config.name}: {config.protocol.kind} on {config.data.source}")
    row = {"run": config.name, "protocol": config.protocol.kind,
           **summarize(records, target, direction, config.eval.target, config.eval.headline, config.eval.select)}
    row.update(run_downstream(config, data_dir, recorder.run_dir, resume, run_single))
    recorder.write_text("summary.md", markdown_table([row]))
    return row
