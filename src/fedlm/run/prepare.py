"""Config -> data -> partition -> tokenizer -> model -> task: everything a run needs, built once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from fedlm.config import ExperimentConfig, GenerationConfig, IidPartitionConfig
from fedlm.data.inputs import partition_input, partition_labels  # noqa: F401 (partition_labels: run.single)
from fedlm.data.partition import Partition, PartitionInput, build_partitioner, holdout_split, partition_cached
from fedlm.data.sources import LoadedData, load_source
from fedlm.errors import UserError
from fedlm.federation.attacks import Attack
from fedlm.models.build import build_model, build_tokenizer, check_max_length
from fedlm.models.device import check_precision, resolve_device
from fedlm.models.presets import is_decoder_family
from fedlm.models.quantization import enable_checkpointing, is_quantized
from fedlm.run.attack_setup import set_up_attack
from fedlm.tasks import MaskedLMTask, Task, get_task

if TYPE_CHECKING:
    from fedlm.models.adapters import Adapter


def resolve_task(requested: str, data_kind: str, family: str) -> str:
    """The task a run trains: the config's, or the one its data implies (LM text -> masked or causal LM)."""
    if requested != "auto":
        if requested == "chat":  # decoder-only seq2seq (model, head, split path) whose sources are conversations
            if data_kind != "chat":
                raise UserError("task = 'chat' needs conversations from a local JSONL / JSON / Parquet / CSV file "
                                f"(messages, instruction / output or prompt / response columns), not {data_kind} data")
            return "seq2seq"
        if requested == "seq2seq" and data_kind != "seq2seq":
            raise UserError("task = 'seq2seq' needs source and target text: map the target column with "
                            "data.columns {text: <source column>, target: <target column>}")
        if requested in ("tagging", "qa") and data_kind != requested:
            what = "tagged sentences (CoNLL columns or tokens/tags JSONL)" if requested == "tagging" else (
                "questions with contexts and answers (SQuAD JSON or JSONL)")
            raise UserError(f"task = {requested!r} needs {what}, but the data source is {data_kind} data")
        if requested == "multiple_choice" and data_kind != "classification":
            raise UserError("task = 'multiple_choice' needs labelled prompts whose label names are the options (a "
                            f"classification source such as pubmedqa), but the data source is {data_kind} data")
        if requested not in ("mlm", "clm") and data_kind == "lm":
            raise UserError(f"task = {requested!r} needs labels, but the data source is unlabeled text")
        return requested
    if data_kind == "lm":
        return "clm" if is_decoder_family(family) else "mlm"
    return data_kind


def num_clients_of(config: ExperimentConfig) -> int:
    return config.num_clients()


def build_task(config: ExperimentConfig, task_name: str, label_names: list[str] | None = None,
               encoder_decoder: bool = False) -> Task:
    """The task object; ``train.mask_rate`` belongs to masked LM only, ``generation`` to seq2seq only
    (``encoder_decoder``: the model has an encoder and a decoder, else seq2seq prompts a decoder-only LM).
    Evaluation autocasts as training does: the task takes ``train.precision``."""
    precision = config.train.precision
    if config.eval.metrics is not None and task_name not in ("multiple_choice", "seq2seq"):
        raise UserError(f"eval.metrics selects multiple_choice, seq2seq and chat metrics, but the task is "
                        f"{task_name}: remove eval.metrics")
    if task_name == "seq2seq":
        if encoder_decoder and config.split is not None:
            raise UserError(f"split learning cuts one stack of blocks, and this {config.model.family} model is an "
                            "encoder-decoder; use a decoder-only family for split seq2seq, or remove the split section")
        gen = config.generation
        if config.task == "chat":  # the rows are conversations, the model a decoder-only seq2seq one
            if encoder_decoder:
                raise UserError(f"task chat fine-tunes a decoder-only LM, and {config.model.family} is an "
                                "encoder-decoder; use a decoder-only family (gpt2, llama, gemma3_text ...)")
            return get_task("chat", template=config.data.chat_template, num_beams=gen.num_beams,
                            max_new_tokens=gen.max_new_tokens, metrics=config.eval.metrics, precision=precision)
        return get_task(task_name, encoder_decoder=encoder_decoder, num_beams=gen.num_beams,
                        max_new_tokens=gen.max_new_tokens, metrics=config.eval.metrics, precision=precision)
    if config.generation != GenerationConfig():
        raise UserError(f"generation is for seq2seq, but the task is {task_name}: remove the generation section")
    if task_name == "mlm":
        return get_task(task_name, mask_rate=config.train.mask_rate, precision=precision)
    if config.train.mask_rate != MaskedLMTask.default_mask_rate:
        raise UserError(f"train.mask_rate is for masked LM, but the task is {task_name}: remove train.mask_rate")
    if task_name == "tagging":  # seqeval scores tag strings: the training split's tag set
        return get_task(task_name, label_names=label_names, precision=precision)
    if task_name == "multiple_choice":  # a classification source's label names are every item's options
        return get_task(task_name, options=label_names, metrics=config.eval.metrics, precision=precision)
    if task_name == "qa":
        return get_task(task_name, doc_stride=config.model.doc_stride,
                        max_answer_length=config.eval.max_answer_length, precision=precision)
    return get_task(task_name, precision=precision)


@dataclass
class Prepared:
    """Everything a run needs, built once: per-client tokenized rows, the model, the task."""

    config: ExperimentConfig
    loaded: LoadedData
    task_name: str
    task: Task
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module
    client_train: dict[int, list[dict]]
    client_test: dict[int, list[dict]]
    test_rows: list[dict]
    train_partition: Partition
    train_input: PartitionInput
    partition_sizes: dict[str, list[int]] = field(default_factory=dict)
    adapter: Adapter | None = None  # with one, ``model`` holds it and only its weights (+ head) train
    attack: Attack | None = None  # the ``attack`` section: its clients' rows are poisoned already
    triggered_test: list[dict] = field(default_factory=list)  # a backdoor's test rows (its success rate)
    validation_rows: list[dict] = field(default_factory=list)  # the validation split a run scores, if any


def split_rows(task: Task, ds: datasets.Dataset, part: Partition, tokenizer: PreTrainedTokenizerBase,
               max_length: int, whole: list[dict] | None) -> dict[int, list[dict]]:
    """Each client's tokenized rows. ``whole`` is the split tokenized once, for a task that makes one row per
    example (``Task.row_wise``): each client gets its examples' rows, a millisecond per client instead of a
    ``datasets.map`` each. Without it (language modelling packs a client's blocks from its own text, QA cuts
    windows) each client's share is tokenized separately."""
    if whole is not None:
        return {cid: [whole[i] for i in part.client_indices(cid)] for cid in range(part.num_clients)}
    out = {}
    for cid in range(part.num_clients):
        idx = part.client_indices(cid)
        out[cid] = task.preprocess(ds.select(idx), tokenizer, max_length).to_list() if len(idx) else []
    return out


def load_data(config: ExperimentConfig, data_dir: Path) -> LoadedData:
    data = config.data
    loaded = load_source(data.source, data_dir, columns=data.columns, file_format=data.format,
                         test_fraction=data.test_fraction, seed=config.seed,
                         max_train_examples=data.max_train_examples, max_test_examples=data.max_test_examples,
                         task=config.task)
    return with_validation(loaded, data.validation_fraction, config.eval.select == "best", config.seed)


def scores_validation(config: ExperimentConfig) -> bool:
    """Whether a run scores a validation split: asked for by data.validation_fraction or eval.select: best."""
    return config.data.validation_fraction is not None or config.eval.select == "best"


def with_validation(loaded: LoadedData, fraction: float | None, needed: bool, seed: int) -> LoadedData:
    """``loaded`` with the validation split a run scores (see ``scores_validation``): the source's own where it
    has one (CoNLL-2003, NCBI-disease, wikitext-2); else, given ``fraction``, a seeded share of the training split
    held out before any partitioning (the server's own set, as a central dev set would be)."""
    own = "validation" in loaded.splits
    if own and fraction is not None:
        raise UserError(f"data.validation_fraction: this source has a validation split of its own "
                        f"({len(loaded.splits['validation'])} examples), which eval.select: best scores; remove "
                        "data.validation_fraction (and set eval.select: best to score it)")
    if own or fraction is None:
        if needed and not own:
            raise UserError("eval.select: best picks a round by its validation score, and this source has no "
                            "validation split: set data.validation_fraction (e.g. 0.1 of the training split), or "
                            "eval.select: last")
        return loaded
    train = loaded.splits["train"]
    held = round(fraction * len(train))
    if held < 1 or held >= len(train):
        raise UserError(f"data.validation_fraction {fraction:g} of {len(train)} training examples leaves "
                        f"{held} for validation and {len(train) - held} for training; both need at least one: "
                        "raise the fraction, or use more training data")
    parts = train.train_test_split(test_size=held, seed=seed, shuffle=True)
    splits = datasets.DatasetDict({**loaded.splits, "train": parts["train"], "validation": parts["test"]})
    return dataclasses.replace(
        loaded, splits=splits, fingerprint=f"{loaded.fingerprint}|validation={held}@{seed}",
        split_note=f"{loaded.split_note}; {held} training examples held out as the validation split (seed {seed})")


def prepare(config: ExperimentConfig, data_dir: Path, cache_dir: Path | None = None) -> Prepared:
    device = resolve_device(config.train.device)  # a missing device stops the run before any data is read
    check_precision(device, config.train.precision)
    loaded = load_data(config, data_dir)
    task_name = resolve_task(config.task, loaded.kind, config.model.family)
    n_clients = num_clients_of(config)
    partitioner = build_partitioner(IidPartitionConfig() if n_clients == 1 else config.partition)
    train_input = partition_input(loaded, "train")
    train_part = partition_cached(partitioner, train_input, n_clients, config.seed, cache_dir)
    train = loaded.splits["train"]
    if partitioner.holdout > 0:  # local test splits carved from each client's own training share
        train_part, test_part = holdout_split(train_part, partitioner.holdout, config.seed)
        local_test_source = train
    else:  # the test split partitioned with the same seed: each client's label mix matches its train share;
        # without local evaluation only the global test split is scored, and no client needs a share of it
        test_part = None
        if config.eval.local and config.protocol.traits.evaluates_clients:
            test_input = partition_input(loaded, "test")
            if test_input.n < n_clients:
                raise UserError(f"the test split has {test_input.n} examples, fewer than the {n_clients} clients "
                                f"that each need a share of it for eval.local (the training data has "
                                f"{train_input.n}); set eval.local: false (the global test split is scored either "
                                "way), lower partition.num_clients, or set partition.holdout to carve each "
                                "client's local test examples from its training share")
            test_part = partition_cached(partitioner.for_test(train_input), test_input, n_clients, config.seed,
                                         cache_dir)
        local_test_source = loaded.splits["test"]
    texts = train["text"][:] + [t for c in ("text_pair", "target") if c in train.column_names for t in train[c][:]]
    tokenizer = build_tokenizer(config.model.checkpoint, config.model.family, texts,
                                config.model.vocab_size, cache_dir)
    num_labels = len(loaded.label_names) if loaded.label_names else None
    model = build_model(config.model.family, config.model.preset, task_name, tokenizer, num_labels=num_labels,
                        checkpoint=config.model.checkpoint, overrides=config.model.overrides, seed=config.seed,
                        pooling=config.model.pooling, quantization=config.model.quantization, device=device)
    check_max_length(model, config.model.max_length)
    if config.train.gradient_checkpointing:
        enable_checkpointing(model)
    adapter = None
    if config.adapter is not None:
        from fedlm.models.adapters import apply_adapter  # here: peft (and bitsandbytes through it) takes seconds

        adapter = apply_adapter(config.adapter, model, task_name, config.seed)
    if not is_quantized(model):  # bitsandbytes placed a quantized base itself (it cannot be moved)
        model.to(device)  # every copy (split clients, trunk) and every loaded tensor follows the model's device
    task = build_task(config, task_name, loaded.label_names,
                      encoder_decoder=bool(getattr(model.config, "is_encoder_decoder", False)))
    max_len = config.model.max_length
    test_rows = task.preprocess(loaded.splits["test"], tokenizer, max_len).to_list()
    validation_rows = task.preprocess(loaded.splits["validation"], tokenizer, max_len).to_list() \
        if scores_validation(config) else []
    train_rows = task.preprocess(train, tokenizer, max_len).to_list() if task.row_wise else None
    client_train = split_rows(task, train, train_part, tokenizer, max_len, train_rows)
    if test_part is None:  # no local evaluation: the global test split only
        client_test: dict[int, list[dict]] = {}
    else:
        whole = (test_rows if local_test_source is loaded.splits["test"] else train_rows) if task.row_wise else None
        client_test = split_rows(task, local_test_source, test_part, tokenizer, max_len, whole)
    attacked = set_up_attack(config, task_name, loaded.label_names, tokenizer, client_train, test_rows)
    if attacked is not None:
        client_train = attacked.client_train
    return Prepared(
        attack=attacked.attack if attacked else None, triggered_test=attacked.triggered_test if attacked else [],
        config=config, loaded=loaded, task_name=task_name, task=task, tokenizer=tokenizer, model=model,
        client_train=client_train, client_test=client_test, test_rows=test_rows,
        partition_sizes={"train": train_part.sizes().tolist(),
                         "test": test_part.sizes().tolist() if test_part is not None else []},
        train_partition=train_part, train_input=train_input, adapter=adapter, validation_rows=validation_rows,
    )
