"""From a validated config to a finished run: data -> partition -> model -> round engine -> run directory."""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from fedlm.config import ExperimentConfig, downstream_config, dump_config, expand_grid, read_yaml, validate
from fedlm.data.partition import Partition, PartitionInput, build_partitioner, holdout_split, partition_cached
from fedlm.data.partition_stats import write_partition_report
from fedlm.data.sources import LoadedData, load_source
from fedlm.errors import UserError
from fedlm.federation.codecs import get_codec
from fedlm.federation.engine import EngineHooks, RoundEngine, RoundPlan
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import NamedTensors, load_into, nbytes, snapshot, trainable_names
from fedlm.federation.sharing import SharingPolicy, build_policy, layer_of
from fedlm.federation.simulation import ClientStore, InProcessExecutor, make_client_store
from fedlm.federation.strategies.base import build_strategy
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Cut, SplitModel
from fedlm.run.recorder import RunRecorder, read_metrics
from fedlm.run.report import markdown_table, plot_grid, plot_run, summarize
from fedlm.split.executor import SplitExecutor, split_parts
from fedlm.tasks import MaskedLMTask, get_task

log = logging.getLogger("fedlm")
DECODERS = ("gpt2", "llama")


def resolve_task(requested: str, data_kind: str, family: str) -> str:
    if requested != "auto":
        if (requested in ("mlm", "clm")) != (data_kind == "lm") and data_kind == "lm":
            raise UserError(f"task = {requested!r} needs labels, but the data source is unlabeled text")
        return requested
    if data_kind == "lm":
        return "clm" if family in DECODERS else "mlm"
    return data_kind


def num_clients_of(config: ExperimentConfig) -> int:
    return 1 if config.protocol.kind == "centralized" else config.partition.num_clients


@dataclass
class Prepared:
    """Everything a run needs, built once: per-client tokenized rows, the model, the task."""

    config: ExperimentConfig
    loaded: LoadedData
    task_name: str
    task: Any
    tokenizer: Any
    model: torch.nn.Module
    client_train: dict[int, list[dict]]
    client_test: dict[int, list[dict]]
    test_rows: list[dict]
    train_partition: Partition
    train_input: PartitionInput
    partition_sizes: dict[str, list[int]] = field(default_factory=dict)


def partition_input(loaded: LoadedData, split: str) -> PartitionInput:
    ds = loaded.splits[split]
    labels = np.asarray(ds["label"]) if "label" in ds.column_names else None
    extra = {c: ds[c] for c in ds.column_names if c not in ("text", "text_pair", "label")}
    return PartitionInput(n=len(ds), labels=labels, texts=ds["text"], columns=extra or None,
                          fingerprint=f"{loaded.fingerprint}:{split}")


def split_rows(task: Any, ds: Any, part: Partition, tokenizer: Any, max_length: int) -> dict[int, list[dict]]:
    """Tokenize each client's share separately: for LM tasks a client's blocks are packed from its own text."""
    rows = {}
    for cid in range(part.num_clients):
        idx = part.client_indices(cid)
        rows[cid] = task.preprocess(ds.select(idx), tokenizer, max_length).to_list() if len(idx) else []
    return rows


def prepare(config: ExperimentConfig, data_dir: Path, cache_dir: Path | None = None) -> Prepared:
    loaded = load_source(config.data.source, data_dir, columns=config.data.columns,
                         file_format=config.data.format, test_fraction=config.data.test_fraction,
                         seed=config.seed, max_train_examples=config.data.max_train_examples,
                         max_test_examples=config.data.max_test_examples)
    task_name = resolve_task(config.task, loaded.kind, config.model.family)
    n_clients = num_clients_of(config)
    spec = {"kind": "iid"} if n_clients == 1 else config.partition.spec()
    partitioner = build_partitioner(spec)
    train_input = partition_input(loaded, "train")
    train_part = partition_cached(partitioner, train_input, n_clients, config.seed, cache_dir)
    train = loaded.splits["train"]
    if partitioner.holdout > 0:  # local test splits carved from each client's own training share
        train_part, test_part = holdout_split(train_part, partitioner.holdout, config.seed)
        local_test_source = train
    else:  # the test split partitioned with the same seed: each client's label mix matches its train share
        test_part = partition_cached(partitioner, partition_input(loaded, "test"), n_clients, config.seed, cache_dir)
        local_test_source = loaded.splits["test"]
    texts = list(train["text"]) + (list(train["text_pair"]) if "text_pair" in train.column_names else [])
    tokenizer = build_tokenizer(config.model.checkpoint, config.model.family, texts,
                                config.model.vocab_size, cache_dir)
    num_labels = len(loaded.label_names) if loaded.label_names else None
    model = build_model(config.model.family, config.model.preset, task_name, tokenizer, num_labels=num_labels,
                        checkpoint=config.model.checkpoint, overrides=config.model.overrides, seed=config.seed)
    if task_name == "mlm":
        task = get_task(task_name, mask_rate=config.train.mask_rate)
    elif config.train.mask_rate != MaskedLMTask.default_mask_rate:
        raise UserError(f"train.mask_rate is for masked LM, but the task is {task_name}: remove train.mask_rate")
    else:
        task = get_task(task_name)
    max_len = config.model.max_length
    test_ds = task.preprocess(loaded.splits["test"], tokenizer, max_len)
    return Prepared(
        config=config, loaded=loaded, task_name=task_name, task=task, tokenizer=tokenizer, model=model,
        client_train=split_rows(task, train, train_part, tokenizer, max_len),
        client_test=split_rows(task, local_test_source, test_part, tokenizer, max_len),
        test_rows=test_ds.to_list(),
        partition_sizes={"train": train_part.sizes().tolist(), "test": test_part.sizes().tolist()},
        train_partition=train_part, train_input=train_input,
    )


class Evaluator:
    """Global model on the global test split; each evaluated client's model on its local test split.

    When clients keep local parameters (personalized runs), there is no single global model: each client's
    own model (global part + its local part) is scored on the global test split too, as mean and std."""

    def __init__(self, prep: Prepared, store: ClientStore, personalized: bool) -> None:
        self.prep = prep
        self.store = store
        self.personalized = personalized
        self.batch_size = prep.config.eval.batch_size
        self.local = prep.config.eval.local and prep.config.protocol.kind != "centralized"

    def _score(self, rows: list[dict]) -> dict[str, float]:
        generator = torch.Generator().manual_seed(self.prep.config.seed)
        return self.prep.task.evaluate(self.prep.model, rows, self.batch_size, generator)

    def _client_model(self, global_params: NamedTensors, client_id: int) -> None:
        load_into(self.prep.model, global_params)
        load_into(self.prep.model, self.store.get(client_id))

    def __call__(self, round_idx: int, global_params: NamedTensors, clients: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.personalized:
            per_client = {}
            for cid in clients:
                self._client_model(global_params, cid)
                per_client[cid] = self._score(self.prep.test_rows)
            out.update(_spread("test", per_client))
        else:
            load_into(self.prep.model, global_params)
            out.update({f"test_{k}": v for k, v in self._score(self.prep.test_rows).items()})
        if self.local:
            per_client = {}
            for cid in clients:
                if self.prep.client_test.get(cid):
                    self._client_model(global_params, cid)
                    per_client[cid] = self._score(self.prep.client_test[cid])
            out.update(_spread("local", per_client))
        return out


def _spread(prefix: str, per_client: dict[int, dict[str, float]]) -> dict[str, Any]:
    """Mean and std over clients of every metric, plus the per-client values."""
    if not per_client:
        return {}
    out: dict[str, Any] = {}
    for metric in next(iter(per_client.values())):
        values = np.array([m[metric] for m in per_client.values()], dtype=float)
        out[f"{prefix}_{metric}_mean"] = float(values.mean())
        out[f"{prefix}_{metric}_std"] = float(values.std())
    out[f"{prefix}_by_client"] = {str(c): m for c, m in per_client.items()}
    return out


def _progress_enabled() -> bool:
    return sys.stderr.isatty()


def run_single(config: ExperimentConfig, data_dir: Path, run_dir: Path, *, resume: bool = False,
               executor_factory: Any = None, split_remote: Any = None) -> dict[str, Any]:
    """Run (or resume) one experiment into ``run_dir``; returns its summary row. ``executor_factory`` runs
    the clients elsewhere (Flower); for a split run, ``split_remote`` does (see ``SplitExecutor``)."""
    recorder = RunRecorder(run_dir)
    checkpoint = recorder.load_checkpoint() if resume else None
    if not resume:
        if recorder.metrics_path.exists():
            recorder.metrics_path.unlink()
        recorder.write_text("config.yaml", dump_config(config))
    torch.manual_seed(config.seed)
    prep = prepare(config, data_dir, cache_dir=Path(config.output_dir) / ".cache")
    recorder.write_json("data.json", {
        "source": config.data.source, "kind": prep.loaded.kind, "task": prep.task_name,
        "label_names": prep.loaded.label_names, "split_note": prep.loaded.split_note,
        "train_examples": len(prep.loaded.splits["train"]), "test_examples": len(prep.loaded.splits["test"]),
        "partition": config.partition.spec(), "client_sizes": prep.partition_sizes,
    })
    write_partition_report(run_dir / "partition", prep.train_partition, prep.train_input, prep.loaded.label_names)
    protocol = config.protocol
    n_clients = num_clients_of(config)
    if config.split is not None and executor_factory is not None and split_remote is None:
        raise UserError("this deployment runs FedAvg clients only; split learning needs the trunk served to the "
                        "clients (split_remote), as fedlm's Flower ServerApp does")
    policy = split_policy(prep) if config.split is not None else sharing_policy(prep, n_clients)
    if config.downstream and not encoder_is_global(policy):  # refuse before training, not after it
        raise UserError("downstream fine-tuning needs one global encoder, but this run keeps blocks or embeddings "
                        "on the clients (sharing.critical_layer / isolated / split.client_parts local); drop "
                        "`downstream` or share every layer")
    recorder.write_json("sharing.json", describe_policy(policy, prep.model))
    initial = snapshot(prep.model, policy.global_names + policy.local_names)
    store = make_client_store({n: initial[n] for n in policy.local_names}, n_clients, config.sharing.local_store,
                              recorder.client_store_path, run_dir / "client_states")
    global_params = {n: initial[n] for n in policy.global_names}
    strategy = build_strategy(protocol)
    codec = get_codec("fp32") if protocol.kind == "centralized" else get_codec(protocol.codec,
                                                                                protocol.codec_block_size)
    start = 1
    if checkpoint is not None:
        global_params = checkpoint["global"]
        strategy.load_state_dict(checkpoint["strategy"])
        store.restore()
        start = checkpoint["round"] + 1
        recorder.truncate_after(checkpoint["round"])
        log.info("resuming %s from round %d", run_dir, start)
    elif resume:
        recorder.truncate_after(0)
    per_round = n_clients if protocol.kind in ("isolated", "centralized") else (
        protocol.clients_per_round or max(1, round(protocol.fraction * n_clients)))
    plan = RoundPlan(rounds=protocol.rounds, clients_per_round=min(per_round, n_clients),
                     min_clients=min(protocol.min_clients, per_round), max_retries=protocol.max_retries,
                     timeout_s=protocol.client_timeout_s, seed=config.seed,
                     count_bytes=protocol.kind not in ("centralized", "isolated"),
                     eval_every=config.eval.every, checkpoint_every=config.checkpoint_every)
    target, direction = prep.task.target_metric()
    bar = tqdm(total=protocol.rounds, initial=start - 1, desc=f"{config.name} rounds", unit="round",
               disable=not _progress_enabled(), dynamic_ncols=True)
    client_bar = tqdm(total=plan.clients_per_round, desc="clients", leave=False, unit="client",
                      disable=not _progress_enabled(), dynamic_ncols=True)

    def on_client(_: int) -> None:
        client_bar.update(1)

    def on_round(round_idx: int, record: dict[str, Any]) -> None:
        client_bar.reset()
        bar.update(1)
        headline = {k: v for k, v in record.items() if k.startswith(("test_", "local_")) and target in k
                    and not k.endswith("by_client")}
        bar.set_postfix({k: f"{v:.4f}" for k, v in headline.items()} | {"loss": f"{record['train_loss']:.4f}"})
        if not _progress_enabled():
            shown = " ".join(f"{k}={v:.4f}" for k, v in headline.items())
            print(f"[{config.name}] round {round_idx}/{protocol.rounds} train_loss={record['train_loss']:.4f} "
                  f"{shown} wall={record['wall_s']:.1f}s", flush=True)

    def save_checkpoint(round_idx: int, params: NamedTensors) -> None:
        store.commit()
        recorder.save_checkpoint(round_idx, {"global": params, "strategy": strategy.state_dict()})

    settings = LocalSettings.from_config(config.train)
    hooks = EngineHooks(evaluate=Evaluator(prep, store, policy.personalized), record=recorder.log_round,
                        checkpoint=save_checkpoint, on_round=on_round, frozen_for=policy.frozen_for)
    if config.split is not None:
        executor = split_executor(prep, codec, store, settings, on_client, split_remote)
        hooks.downlink, hooks.begin_round = executor.downlink, executor.begin_round
    else:
        executor = (executor_factory or InProcessExecutor)(
            prep.model, prep.task, prep.client_train, codec, store, policy.local_names, progress=on_client)
    engine = RoundEngine(strategy=strategy, executor=executor, codec=codec, client_ids=list(range(n_clients)),
                         settings=settings, plan=plan, hooks=hooks)
    try:
        final = engine.run(global_params, start_round=start)
    finally:
        if isinstance(executor, SplitExecutor):
            executor.close()
    bar.close()
    client_bar.close()
    save_final_model(prep, final, store, run_dir / "model", policy.personalized, n_clients,
                     head_only=encoder_is_global(policy))
    records = recorder.records()
    plot_run(records, target, run_dir, f"{config.name}: {protocol.kind} on {config.data.source}")
    row = {"run": config.name, "protocol": protocol.kind, **summarize(records, target, direction, config.eval.target,
                                                                      config.eval.headline)}
    row.update(run_downstream(config, data_dir, run_dir, resume))
    recorder.write_text("summary.md", markdown_table([row]))
    return row


def run_downstream(config: ExperimentConfig, data_dir: Path, run_dir: Path, resume: bool) -> dict[str, Any]:
    """Fine-tune the saved model on each downstream task (FDAPT / FedBERT evaluate pre-training this way),
    skipping those already finished when resuming; returns each task's final score, keyed '<name> <metric>'."""
    scores: dict[str, Any] = {}
    for name in config.downstream:
        sub = downstream_config(config, name, str(run_dir / "model"))
        sub_dir = run_dir / "downstream" / slug(name)
        if not (resume and _finished(sub_dir, sub.protocol.rounds)):
            log.info("%s: fine-tuning on downstream task %s", config.name, name)
            run_single(sub, data_dir, sub_dir, resume=resume and (sub_dir / "config.yaml").exists())
        scores.update(downstream_scores(run_dir, [slug(name)]))
    return scores


def downstream_scores(run_dir: Path, names: list[str] | None = None) -> dict[str, Any]:
    """Final scores of a run's finished downstream fine-tuning runs, keyed '<name> <metric>'."""
    folder = run_dir / "downstream"
    found = names if names is not None else sorted(p.name for p in folder.glob("*") if (p / "data.json").is_file())
    scores: dict[str, Any] = {}
    for name in found:
        metric, direction = get_task(_task_of(folder / name)).target_metric()
        scores[f"{name} {metric}"] = summarize(read_metrics(folder / name), metric, direction)[f"final {metric}"]
    return scores


def sharing_policy(prep: Prepared, n_clients: int) -> SharingPolicy:
    """Resolve the config's sharing section on this model; parameters frozen for everyone stop needing grads."""
    names = trainable_names(prep.model)
    sizes = {cid: len(prep.client_train.get(cid, [])) for cid in range(n_clients)}
    policy = build_policy(prep.config.sharing, prep.config.protocol.kind, names, sizes)
    params = dict(prep.model.named_parameters())
    for name in policy.frozen_names:
        params[name].requires_grad_(False)
    return policy


def split_policy(prep: Prepared) -> SharingPolicy:
    """Split runs: the trunk and the shared client parts are global, the kept client parts local."""
    spec = prep.config.split
    return split_parts(SplitModel(prep.model, Cut(spec.bottom_blocks, spec.top_blocks)), spec.client_parts).policy()


def split_executor(prep: Prepared, codec: Any, store: ClientStore, settings: LocalSettings,
                   progress: Any, remote: Any = None) -> SplitExecutor:
    spec = prep.config.split
    return SplitExecutor(prep.model, Cut(spec.bottom_blocks, spec.top_blocks), spec.trunk_mode, spec.client_parts,
                         prep.task, prep.client_train, codec, store, settings, transport=spec.transport,
                         progress=progress, activation_dtype=spec.activation_dtype,
                         optimizer_state=spec.optimizer_state, remote=remote)


def encoder_is_global(policy: SharingPolicy) -> bool:
    """Every embedding and block is shared, so one encoder exists (clients may keep pre-training heads,
    which downstream fine-tuning replaces anyway)."""
    return all(layer_of(name) == "head" for name in policy.local_names)


def describe_policy(policy: SharingPolicy, model: torch.nn.Module) -> dict[str, Any]:
    """What the run shares, for its directory: names and sizes of the global, local and frozen parts."""
    params = dict(model.named_parameters())

    def part(names: list[str]) -> dict[str, Any]:
        size = nbytes({n: params[n].detach() for n in names})
        return {"tensors": len(names), "fp32_bytes": size, "names": names}

    out = {"global": part(policy.global_names), "local": part(policy.local_names),
           "frozen": part(policy.frozen_names)}
    if policy.window is not None:
        out["freeze_window"] = {"epsilon": policy.window.epsilon, "gamma": policy.window.gamma,
                                "blocks": policy.window.blocks,
                                "blocks_frozen_per_client": {c: policy.window.count(c) for c in policy.window.sizes}}
    return out


def save_final_model(prep: Prepared, final: NamedTensors, store: ClientStore, path: Path, personalized: bool,
                     n_clients: int, head_only: bool = False) -> None:
    """Save with save_pretrained so the result loads in plain transformers (personalized: one per client, <= 10;
    when clients keep only their heads, the shared encoder with client 0's head is also saved at ``path``)."""
    if personalized:
        for cid in range(min(n_clients, 10)):
            load_into(prep.model, final)
            load_into(prep.model, store.get(cid))
            prep.model.save_pretrained(path / f"client_{cid}")
            prep.tokenizer.save_pretrained(path / f"client_{cid}")
        if not head_only:
            return
        load_into(prep.model, store.get(0))
    load_into(prep.model, final)
    prep.model.save_pretrained(path)
    prep.tokenizer.save_pretrained(path)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_") or "run"


def run_config(config: ExperimentConfig, data_dir: Path, output_dir: Path | None = None) -> Path:
    """Run a config, or every combination of its grid; returns the run (or grid) directory."""
    root = (output_dir or Path(config.output_dir)) / slug(config.name)
    runs = expand_grid(config)
    if len(runs) == 1 and not runs[0][0]:
        row = run_single(config, data_dir, root)
        print(markdown_table([row]))
        return root
    return _run_grid(config, runs, data_dir, root)


def _run_grid(config: ExperimentConfig, runs: list, data_dir: Path, root: Path, resume: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "grid.yaml").write_text(dump_config(config))
    rows, curves = [], []
    for label, sub in runs:
        run_dir = root / slug(label)
        done = resume and _finished(run_dir, sub.protocol.rounds)
        if not done:
            sub = sub.model_copy(update={"name": f"{config.name}[{label}]"})
            run_single(sub, data_dir, run_dir, resume=resume and (run_dir / "config.yaml").exists())
        records = read_metrics(run_dir)
        target, direction = get_task(_task_of(run_dir)).target_metric()
        rows.append({"run": label, **summarize(records, target, direction, sub.eval.target, sub.eval.headline),
                     **run_downstream(sub, data_dir, run_dir, resume=True)})  # finishes any interrupted one
        curves.append((label, records))
    plot_grid(curves, target, root / "comparison.png", f"{config.name}: {target} per round", config.eval.headline)
    table = markdown_table(rows)
    (root / "comparison.md").write_text(table)
    print(table)
    return root


def _task_of(run_dir: Path) -> str:
    import json

    return json.loads((run_dir / "data.json").read_text())["task"]


def _finished(run_dir: Path, rounds: int) -> bool:
    records = read_metrics(run_dir)
    return bool(records) and records[-1].get("round") == rounds and (run_dir / "model").exists()


def resume_run(run_dir: Path, data_dir: Path) -> Path:
    """Continue a run (or every unfinished run of a grid) from its last checkpoint."""
    if (run_dir / "grid.yaml").is_file():
        config = validate(read_yaml(run_dir / "grid.yaml"))
        return _run_grid(config, expand_grid(config), data_dir, run_dir, resume=True)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--resume {run_dir}: no config.yaml there; give the directory a run wrote")
    config = validate(read_yaml(run_dir / "config.yaml"))
    row = run_single(config, data_dir, run_dir, resume=True)
    print(markdown_table([row]))
    return run_dir
