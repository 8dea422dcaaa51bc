"""The whole config: its sections, reading and validating YAML with one-line errors, and dumping it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from fedlm.config.dp_support import SAMPLE_DP
from fedlm.config.partition import IidPartitionConfig, PartitionConfig, PartitionSection
from fedlm.config.sections import (
    AdapterConfig,
    AttackConfig,
    DataConfig,
    EvalConfig,
    GenerationConfig,
    ModelConfig,
    PrivacyConfig,
    ProtocolConfig,
    Section,
    SharingConfig,
    SplitConfig,
    TrainConfig,
)
from fedlm.errors import UserError


class ExperimentConfig(Section):
    name: str = "run"
    tags: dict[str, str] = Field(default_factory=dict, description="labels; a named grid axis writes its own here")
    seed: int = 0
    seeds: list[int] = Field(
        default_factory=list, description="run every configuration once per seed (or give grid.seed); tables show "
                                          "mean ± sd over the seeds and say 'within noise' where 95% t-intervals "
                                          "overlap")
    output_dir: str = "runs"
    task: Literal["auto", "mlm", "clm", "classification", "regression", "seq2seq", "tagging",
                  "qa", "multiple_choice", "chat"] = "auto"
    data: DataConfig
    partition: PartitionConfig = Field(default_factory=IidPartitionConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    protocol: ProtocolConfig = Field(default_factory=ProtocolConfig)
    sharing: SharingConfig = Field(default_factory=SharingConfig)
    split: SplitConfig | None = Field(None, description="set to train by federated split learning")
    adapter: AdapterConfig | None = Field(
        None, description="train a peft adapter (lora, prefix, p_tuning_v2, ia3) on a frozen base, not the whole "
                          "model")
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig, description="differential privacy: client-level "
                                   "DP-FedAvg or sample-level DP-SGD, with epsilon reported every round")
    attack: AttackConfig = Field(default_factory=AttackConfig, description="malicious clients (scaled, sign-flipped "
                                 "or noise updates; flipped labels; a backdoor), to measure a defence")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="seq2seq decoding")
    checkpoint_every: int = Field(1, ge=1)
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list, description="experiment trackers that also get every round's metrics: tensorboard "
                                          "(<run dir>/tensorboard, pip install 'fedlm[tracking]') or wandb")
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    baselines: list[dict[str, Any]] = Field(
        default_factory=list, description="extra runs beside the grid, each a mapping of dotted overrides")
    downstream: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="after the run, fine-tune its saved model on each named task (dotted overrides of a fresh "
                    "config inheriting seed, output_dir, model.family and model.max_length)")

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if self.data.chat_template != "auto" and self.task != "chat":
            raise ValueError(f"data.chat_template is for task chat, and the task is {self.task}: remove it")
        if self.model.preset is None and self.model.checkpoint is None:
            raise ValueError("model: set model.preset (tiny/small/base) or model.checkpoint")
        if self.model.checkpoint is not None and "preset" not in self.model.model_fields_set:
            # The default preset does not apply to a checkpoint: only a preset written out sizes a fresh model
            # (the checkpoint then lends just its tokenizer). Written out as null, so a dumped config reads back
            # the same.
            self.model.preset = None
        if self.split is not None:
            if self.protocol.kind != "fedavg":
                raise ValueError(f"split learning averages with FedAvg; protocol.kind is {self.protocol.kind!r} "
                                 "(set protocol.kind: fedavg, or remove the split section)")
            if self.sharing != SharingConfig():
                raise ValueError("split.client_parts decides what clients share; remove the sharing section")
            if self.model.family in ("t5", "bart"):
                raise ValueError(f"split learning cuts one stack of blocks, and {self.model.family} is an "
                                 "encoder-decoder (its decoder attends to the encoder's output in every block); "
                                 "use a decoder-only family (gpt2, llama) for split seq2seq, or remove the split "
                                 "section")
            if self.train.lr_schedule != "constant":
                raise ValueError(f"train.lr_schedule {self.train.lr_schedule} is for FedAvg-family and centralized "
                                 "runs (the split trunk keeps one learning rate); set train.lr_schedule: constant "
                                 "or remove the split section")
            if self.adapter is not None and self.adapter.kind == "prefix" and self.adapter.projection:
                raise ValueError("adapter.kind prefix with a projection does not run through a split model (one MLP "
                                 "makes every block's prefix, so it belongs to neither side); use adapter.kind "
                                 "p_tuning_v2 (per-block prefixes) or set adapter.projection: false")
        if not self.eval.start and self.protocol.rounds == 0:
            raise ValueError("eval.start: false with protocol.rounds: 0 leaves the run nothing to score; set "
                             "eval.start: true (round 0 is the whole run) or train some rounds")
        sampled = self.protocol.clients_per_round
        if sampled is not None and self.protocol.traits.samples_clients and (
                sampled > self.partition.num_clients):
            raise ValueError(f"protocol.clients_per_round = {sampled} but partition.num_clients = "
                             f"{self.partition.num_clients}: a round cannot sample more clients than there are")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds = {self.seeds} repeats a seed; list each seed once")
        if self.seeds and "seed" in self.grid:
            raise ValueError("seeds and grid.seed both set the seeds; keep one of them")
        if self.adapter is not None and self.downstream:
            raise ValueError("downstream fine-tuning starts from a whole saved model, but with an adapter the run "
                             "saves the adapter; remove downstream or the adapter section")
        self._check_privacy()
        self._check_attack()
        self._check_quantization()
        self._load_partition_column()
        if not self.name.strip(". "):
            raise ValueError(f"name = {self.name!r} would write outside output_dir; give the run a name")
        return self

    def _load_partition_column(self) -> None:
        """A natural partition on a column of the user's data loads that column as the group role, so that
        ``partition.column: hospital`` alone is enough; a written data.columns.group may be named by its column or
        as ``group``. (Sources with columns of their own ignore the implied role: see data.sources.group_only.)"""
        part = self.partition
        if part.kind != "natural":
            return
        given = self.data.written_column("group")
        if given is None:
            self.data.imply_column("group", part.column)
        elif part.column not in (given, "group"):
            raise ValueError(f"partition.column is {part.column!r} but data.columns.group is {given!r}: a natural "
                             f"partition splits on the group column; set partition.column: group (or {given}), "
                             "or remove data.columns.group")

    def _check_quantization(self) -> None:
        """A quantized base is a pretrained checkpoint, frozen under an adapter."""
        if self.model.quantization is None:
            return
        bits = self.model.quantization.bits
        if self.model.checkpoint is None or self.model.preset is not None:
            raise ValueError(f"model.quantization loads a pretrained checkpoint in {bits} bits; a preset builds a "
                             "random model: set model.checkpoint (and model.preset: null), or drop quantization")
        if self.adapter is None:
            raise ValueError(f"a {bits}-bit base cannot be fine-tuned in full (its packed weights do not train): "
                             "add an adapter section (adapter.kind: lora), or drop model.quantization")
        if self.adapter.save_merged:
            raise ValueError("adapter.save_merged would round the trained adapter into the quantized base: set it "
                             "false (the adapter is saved beside the base)")
        if self.privacy.kind == "sample":
            raise ValueError("privacy.kind sample (Opacus' per-example gradients) does not run on quantized layers: "
                             "use privacy.kind client, or drop model.quantization")

    def _check_attack(self) -> None:
        """Attackers must exist, and train as FedAvg-family clients (a split client's parts are not a model update)."""
        attack = self.attack
        if attack.kind == "none":
            return
        if attack.clients is not None and max(attack.clients) >= self.num_clients():
            missing = sorted(c for c in attack.clients if c >= self.num_clients())
            raise ValueError(f"attack.clients names client(s) {missing}, but the run has clients 0 to "
                             f"{self.num_clients() - 1}: name existing clients or use attack.fraction")
        if self.split is not None:
            raise ValueError("attack is for the FedAvg family's clients, not split learning: remove the attack or "
                             "the split section")
        if not self.protocol.traits.averages_updates:
            raise ValueError(f"attack needs clients whose updates the server combines; protocol.kind "
                             f"{self.protocol.kind} has none: use fedavg, fedprox or fedopt")

    def _check_privacy(self) -> None:
        """What each kind of DP runs with: client level needs a server average to noise, sample level Opacus'
        per-example gradients (fp32, no proximal term)."""
        kind = self.privacy.kind
        if kind == "none":
            return
        if self.split is not None:
            raise ValueError(f"privacy.kind {kind} is not offered for split learning (the trunk sees activations, "
                             "not updates); remove the split section or set privacy.kind none")
        if kind == "client" and self.protocol.aggregator != "mean":
            raise ValueError(f"privacy.kind client bounds what one client can change in the clipped mean it noises; "
                             f"protocol.aggregator {self.protocol.aggregator} would take another statistic whose "
                             "guarantee fedlm does not account: use aggregator mean (its clipping already bounds "
                             "each client), or privacy.kind sample")
        if kind == "client" and not self.protocol.traits.averages_updates:
            raise ValueError(f"privacy.kind client noises the server's average of client updates, and protocol.kind "
                             f"{self.protocol.kind} has none; use fedavg, fedprox or fedopt, or privacy.kind sample")
        if kind == "sample":
            if self.protocol.kind == "fedprox":
                raise ValueError("privacy.kind sample (DP-SGD) cannot add FedProx's proximal term to its clipped "
                                 "per-example gradients; use protocol.kind fedavg or fedopt, or privacy.kind client")
            if self.train.precision != "fp32":
                raise ValueError(f"privacy.kind sample (DP-SGD) trains in fp32; train.precision is "
                                 f"{self.train.precision}: set train.precision fp32")
            refusal = SAMPLE_DP.refusal(self.model.family, self.task)
            if refusal is not None:
                raise ValueError(refusal)

    def num_clients(self) -> int:
        """Clients the training data is partitioned among: one for centralized training."""
        return 1 if self.protocol.traits.pools_data else self.partition.num_clients


def format_error(err: ValidationError, within: tuple[str, ...] = ()) -> str:
    """One line for the first problem: the dotted key, the value given, and what is allowed (``within``: the
    location of the validated part when it is not a whole config)."""
    first = err.errors()[0]
    loc = within + tuple(first["loc"])
    key, _ = _locate(loc)
    kind = first["type"]
    if kind in ("extra_forbidden", "missing"):
        _, parent = _locate(loc[:-1])
        if kind == "missing":
            return f"config error: missing required key '{key}'{_for_kind(parent)}"
        allowed = sorted(parent.model_fields) if parent else []
        return f"config error: unknown key '{key}'{_for_kind(parent)} (allowed here: {', '.join(allowed)})"
    value = first.get("input")
    if kind == "union_tag_invalid":
        return (f"config error: {key}.kind = {first['ctx']['tag']!r}: unknown kind; "
                f"choose one of {first['ctx']['expected_tags']}")
    if kind == "union_tag_not_found":
        return f"config error: {key} = {value!r}: should be a mapping with a kind and its parameters"
    message = first["msg"].removeprefix("Value error, ")
    if not loc:  # a rule across sections: the message names its keys, and the whole config is no culprit
        return f"config error: {message}"
    return f"config error: {key} = {value!r}: {message}"


def _locate(loc: tuple) -> tuple[str, type[BaseModel] | None]:
    """The dotted key of an error location (list items as [i], without the tag pydantic adds after a union
    field such as partition) and the section model found there, if any."""
    key, model = "", ExperimentConfig
    tagged: dict[str, type[BaseModel]] = {}
    for part in loc:
        if tagged:
            model, tagged = tagged.get(str(part)), {}
            continue
        if isinstance(part, int):
            key, model = f"{key}[{part}]", None
            continue
        key = f"{key}.{part}" if key else str(part)
        field = model.model_fields.get(str(part)) if model else None
        model, tagged = _sections_of(field.annotation) if field else (None, {})
    return key or "config", model


def _sections_of(annotation: Any) -> tuple[type[BaseModel] | None, dict[str, type[BaseModel]]]:
    """The section model of a field (``X`` or ``X | None``), or the tag -> model map of a tagged union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, {}
    members = get_args(annotation)
    tags = {meta.tag: get_args(member)[0]
            for member in members for meta in getattr(member, "__metadata__", ()) if isinstance(meta, Tag)}
    models = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    return (models[0] if len(models) == 1 and not tags else None), tags


def _for_kind(section: type[BaseModel] | None) -> str:
    """' for kind X' when the section is one kind of partition, whose keys depend on the kind."""
    if section is not None and issubclass(section, PartitionSection):
        return f" for kind {section.model_fields['kind'].default}"
    return ""


_PARTITION = TypeAdapter(PartitionConfig)


def parse_partition(section: Mapping[str, Any]) -> PartitionConfig:
    """A partition section on its own (e.g. ``{"kind": "label_dirichlet", "alpha": 1.0}``), validated exactly as in
    a config file."""
    try:
        return _PARTITION.validate_python(dict(section))
    except ValidationError as err:
        raise UserError(format_error(err, within=("partition",))) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """'protocol.rounds=5' -> (['protocol', 'rounds'], 5); the value is parsed as YAML."""
    if "=" not in text:
        raise UserError(f"override '{text}' is not key=value (example: protocol.rounds=5)")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise UserError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def set_dotted(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override key '{'.'.join(path)}': '{part}' is not a section")
        node = child
    node[path[-1]] = value


def read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"config file {path}{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must hold a mapping of keys, not {type(raw).__name__}")
    return raw


def validate(raw: dict) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise UserError(format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    raw = read_yaml(Path(path))
    for item in overrides:
        keys, value = parse_override(item)
        set_dotted(raw, keys, value)
    return validate(raw)


def dump_config(config: ExperimentConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
