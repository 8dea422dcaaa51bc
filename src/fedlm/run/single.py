"""One run, start to finish: prepare, pick the policy and executor, drive the round engine, save and summarise.

``run_single`` reads as the steps it takes; each step is a small function here or a module of its own
(prepare, policy, evaluate, progress, tracking, downstream, recorder, report).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from fedlm.config import ExperimentConfig, ProtocolConfig
from fedlm.data.partition_stats import write_partition_report
from fedlm.errors import RunStopped, UserError
from fedlm.federation.codecs import Codec, get_codec
from fedlm.federation.dp_sgd import refuse_unsupported
from fedlm.federation.engine import EngineHooks, Executor, RoundEngine, RoundFailed, RoundPlan
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import NamedTensors, load_into, snapshot
from fedlm.federation.privacy import PrivacySpec, with_privacy
from fedlm.federation.sharing import SharingPolicy
from fedlm.federation.simulation import InProcessExecutor
from fedlm.federation.store import ClientStore, make_client_store
from fedlm.federation.strategies import Strategy, build_strategy
from fedlm.run.checkpoint import checkpointer, load_checkpoint
from fedlm.run.downstream import run_downstream
from fedlm.run.evaluate import Evaluator
from fedlm.run.policy import describe_policy, encoder_is_global, run_policy
from fedlm.run.prepare import Prepared, num_clients_of, partition_labels, prepare
from fedlm.run.progress import RoundProgress, announce
from fedlm.run.recorder import RunRecorder
from fedlm.run.report import markdown_table, plot_run, summarize
from fedlm.run.rundir import clear_run, config_text, refuse_existing
from fedlm.run.tracking import Trackers, open_trackers
from fedlm.split.executor import RemoteClients, SplitExecutor
from fedlm.split.trunk import TrunkBackend
from fedlm.tasks import Task

log = logging.getLogger("fedlm")


class ExecutorFactory(Protocol):
    """Builds the executor that runs a FedAvg-family run's clients (``InProcessExecutor``'s constructor, or
    Flower's)."""

    def __call__(self, model: torch.nn.Module, task: Task, client_rows: dict[int, Sequence[dict]], codec: Codec,
                 store: ClientStore, local_names: list[str],
                 progress: Callable[[int], None] | None = None) -> Executor: ...


RemoteFactory = Callable[[TrunkBackend, Codec], RemoteClients]


def run_single(config: ExperimentConfig, data_dir: Path, run_dir: Path, *, resume: bool = False,
               overwrite: bool = False, executor_factory: ExecutorFactory | None = None,
               split_remote: RemoteFactory | None = None) -> dict[str, Any]:
    """Run (or resume) one experiment into ``run_dir``; returns its summary row. A new run refuses a directory
    holding a run unless ``overwrite``, and replaces it only once its config, data and model have loaded.
    ``executor_factory`` runs the clients elsewhere (Flower); for a split run, ``split_remote`` does (see
    ``SplitExecutor``)."""
    if config.split is not None and executor_factory is not None and split_remote is None:
        raise UserError("this deployment runs FedAvg clients only; split learning needs the trunk served to the "
                        "clients (split_remote), as fedlm's Flower ServerApp does")
    if not resume:
        refuse_existing(run_dir, overwrite)
    trackers = open_trackers(config, run_dir, resume)  # a missing tracker package stops the run here
    recorder = RunRecorder(run_dir)
    checkpoint = load_checkpoint(recorder, config) if resume else None  # another config's: refused here
    start = checkpoint["round"] + 1 if checkpoint is not None else 1
    n_clients = num_clients_of(config)
    plan = round_plan(config, n_clients)
    announce(config.name, config.protocol.kind, plan, n_clients, start, run_dir)
    torch.manual_seed(config.seed)
    prep = prepare(config, data_dir, cache_dir=Path(config.output_dir) / ".cache")
    policy = run_policy(prep)
    if config.privacy.kind == "sample":  # the task is known only now; refused before the run directory is touched
        refuse_unsupported(config.model.family, prep.task_name)
    if checkpoint is None:  # a new run (or nothing was checkpointed): it starts over, its starting point included
        if overwrite and not resume:
            clear_run(run_dir)  # only now: config, data and model have loaded
        recorder.start_afresh(config_text(config))
    initial = snapshot(prep.model, policy.global_names + policy.local_names)
    store = make_client_store({n: initial[n] for n in policy.local_names}, n_clients, config.sharing.local_store,
                              run_dir / "client_states")
    global_params = {n: initial[n] for n in policy.global_names}
    strategy = private(build_strategy(config.protocol), prep, plan, n_clients)
    codec = run_codec(config.protocol)
    if checkpoint is not None:
        store.restore(checkpoint["clients"], checkpoint["round"])  # one that does not fit is refused here
        if config.split is not None and config.split.optimizer_state == "carry":
            log.warning("%s: split.optimizer_state carry: checkpoints hold no optimizer state, so the resumed "
                        "rounds start the trunk's and the client parts' optimizers afresh", config.name)
        global_params = checkpoint["global"]
        strategy.load_state_dict(checkpoint["strategy"])
        recorder.truncate_after(checkpoint["round"])
    record_inputs(recorder, prep)
    recorder.write_json("sharing.json", describe_policy(policy, prep.model))
    progress = RoundProgress(config.name, config.protocol.rounds, start, prep.task.target_metric()[0])
    settings = LocalSettings.from_config(config.train, PrivacySpec.from_config(config.privacy).client_settings())
    evaluator = Evaluator(prep, store, policy.personalized, on_batch=progress.eval_batch)
    hooks = EngineHooks(evaluate=progress.evaluating(evaluator), record=recording(recorder, trackers),
                        checkpoint=checkpointer(recorder, store, strategy, config), on_round=progress.round_done,
                        frozen_for=policy.frozen_for)
    executor = progress.watch(build_executor(prep, policy, codec, store, settings, hooks, progress,
                                             executor_factory, split_remote), prep.client_train)
    engine = RoundEngine(strategy=strategy, executor=executor, codec=codec, client_ids=list(range(n_clients)),
                         settings=settings, plan=plan, hooks=hooks)
    try:
        final = engine.run(global_params, start_round=start)
    except RoundFailed as failed:
        raise RunStopped(f"{failed}. The run keeps its rounds before this one; fix the cause and continue with "
                         f"`fedlm run --resume {run_dir}`") from None
    finally:
        executor.close()
        progress.close()
        trackers.close()
    save_final_model(prep, final, store, run_dir / "model", policy.personalized, n_clients,
                     head_only=encoder_is_global(policy))
    return summarise(config, data_dir, recorder, prep.task, resume)


def record_inputs(recorder: RunRecorder, prep: Prepared) -> None:
    """data.json (source, task, split note, sizes) and the partition report, before any training."""
    config = prep.config
    recorder.write_json("data.json", {
        "source": config.data.source, "kind": prep.loaded.kind, "task": prep.task_name,
        "label_names": prep.loaded.label_names, "split_note": prep.loaded.split_note,
        "train_examples": len(prep.loaded.splits["train"]), "test_examples": len(prep.loaded.splits["test"]),
        "partition": config.partition.spec(), "client_sizes": prep.partition_sizes,
    })
    write_partition_report(recorder.run_dir / "partition", prep.train_partition, prep.train_input,
                           partition_labels(prep.loaded, "train")[1])


def private(strategy: Strategy, prep: Prepared, plan: RoundPlan, n_clients: int) -> Strategy:
    """The strategy inside the privacy section's wrapper (client-level noise, the epsilon ledger); itself without
    DP."""
    config = prep.config
    spec = PrivacySpec.from_config(config.privacy)
    return with_privacy(strategy, spec, num_clients=n_clients, clients_per_round=plan.clients_per_round,
                        client_examples={cid: len(rows) for cid, rows in prep.client_train.items()},
                        batch_size=config.train.batch_size, seed=config.seed)


def run_codec(protocol: ProtocolConfig) -> Codec:
    """What crosses the wire: fp32 for centralized (nothing is sent), else the protocol's codec."""
    if protocol.kind == "centralized":
        return get_codec("fp32")
    return get_codec(protocol.codec, protocol.codec_block_size)


def round_plan(config: ExperimentConfig, n_clients: int) -> RoundPlan:
    protocol = config.protocol
    per_round = n_clients if protocol.kind in ("isolated", "centralized") else (
        protocol.clients_per_round or max(1, round(protocol.fraction * n_clients)))
    return RoundPlan(rounds=protocol.rounds, clients_per_round=per_round,
                     min_clients=min(protocol.min_clients, per_round), max_retries=protocol.max_retries,
                     timeout_s=protocol.client_timeout_s, seed=config.seed,
                     count_bytes=protocol.kind not in ("centralized", "isolated"),
                     eval_every=config.eval.every, checkpoint_every=config.checkpoint_every,
                     lr_schedule=config.train.lr_schedule)


def recording(recorder: RunRecorder, trackers: Trackers) -> Callable[[dict[str, Any]], None]:
    """The engine's record hook: each round's record into metrics.jsonl, then to the trackers (report_to)."""

    def record(round_record: dict[str, Any]) -> None:
        recorder.log_round(round_record)
        trackers.log(round_record)

    return record


def build_executor(prep: Prepared, policy: SharingPolicy, codec: Codec, store: ClientStore, settings: LocalSettings,
                   hooks: EngineHooks, progress: RoundProgress, executor_factory: ExecutorFactory | None,
                   split_remote: RemoteFactory | None) -> Executor:
    """Split learning's executor (wired into the engine's hooks), or the FedAvg family's. Clients in this
    process report each step to ``progress``; others, each finished client."""
    if prep.config.split is None:
        if executor_factory is not None:
            return executor_factory(prep.model, prep.task, prep.client_train, codec, store, policy.local_names,
                                    progress=progress.client_done)
        return InProcessExecutor(prep.model, prep.task, prep.client_train, codec, store, policy.local_names,
                                 progress=progress.client_done, on_step=progress.step)
    executor = SplitExecutor(prep.model, prep.config.split, prep.task, prep.client_train, codec, store, settings,
                             hook=progress.boundary_message, progress=progress.client_done, remote=split_remote,
                             max_length=prep.config.model.max_length)
    hooks.downlink, hooks.begin_round = executor.downlink, executor.begin_round
    hooks.server_params = executor.server_params  # the trunk (and share's parts) enter the global model here
    return executor


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
           **summarize(records, target, direction, config.eval.target, config.eval.headline)}
    row.update(run_downstream(config, data_dir, recorder.run_dir, resume, run_single))
    recorder.write_text("summary.md", markdown_table([row]))
    return row
