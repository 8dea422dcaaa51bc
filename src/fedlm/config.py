"""The experiment config: one YAML file, validated into typed sections, with dotted key=value overrides.

Every mistake is reported as one line naming the key, the value and what is allowed (a ``UserError``),
so a typo in a 40-line YAML never surfaces as a traceback half an hour into a run.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedlm.errors import UserError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    source: str = Field(description="named dataset (e.g. glue/sst2) or a local file/directory path")
    columns: dict[str, str] | None = None
    format: Literal["csv", "tsv", "jsonl", "json", "txt"] | None = None
    test_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    max_train_examples: int | None = Field(None, ge=1)
    max_test_examples: int | None = Field(None, ge=1)


class PartitionConfig(BaseModel):
    """`kind` picks the partitioner; its own parameters (alpha, beta, mixes, ...) sit beside it."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)
    kind: str = "iid"
    num_clients: int = Field(10, ge=1)

    def spec(self) -> dict[str, Any]:
        """The partitioner's parameters as a plain dict (without num_clients)."""
        spec = self.model_dump()
        spec.pop("num_clients")
        return spec


class ModelConfig(_Section):
    family: Literal["bert", "roberta", "distilbert", "gpt2", "llama"] = "bert"
    preset: Literal["tiny", "small", "base"] | None = "tiny"
    checkpoint: str | None = Field(None, description="'minilm', a local directory, or a hub name")
    vocab_size: int = Field(8000, ge=100)
    max_length: int = Field(128, ge=8, le=4096)
    overrides: dict[str, Any] = Field(default_factory=dict)


class TrainConfig(_Section):
    """Local training on one client (or on the pooled data, for centralized)."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(5e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    batch_size: int = Field(16, ge=1)
    local_epochs: int = Field(1, ge=1)
    local_steps: int | None = Field(None, ge=1, description="if set, overrides local_epochs")
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    mask_rate: float = Field(0.15, gt=0.0, lt=1.0, description="masked LM: share of tokens a training step "
                             "predicts (evaluation always masks 15%); 0.4 trains small models faster")


class ProtocolConfig(_Section):
    kind: Literal["centralized", "isolated", "fedavg", "fedprox", "fedopt"] = "fedavg"
    rounds: int = Field(10, ge=0, description="0 evaluates and saves the starting model (a baseline)")
    clients_per_round: int | None = Field(None, ge=1, description="sampled clients; overrides fraction")
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    mu: float = Field(0.01, ge=0.0, description="FedProx proximal weight")
    server_optimizer: Literal["adam", "yogi", "adagrad", "sgdm"] = "sgdm"
    server_lr: float = Field(1.0, gt=0.0)
    server_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    tau: float = Field(1e-3, gt=0.0)
    min_clients: int = Field(1, ge=1, description="fewest reporting clients for a round to count")
    max_retries: int = Field(2, ge=0, description="re-runs of a round that got too few reports")
    client_timeout_s: float | None = Field(None, gt=0.0)
    codec: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    codec_block_size: int | None = Field(
        None, ge=1, description="int8: one absmax scale per block of this many values (null: one per tensor)")

    @model_validator(mode="after")
    def _block_size_needs_int8(self) -> ProtocolConfig:
        if self.codec_block_size is not None and self.codec != "int8":
            raise ValueError(f"codec_block_size is for codec int8 (codec is {self.codec}); remove it or use int8")
        return self


class FreezeWindowConfig(_Section):
    """FFDAPT: client k freezes min(epsilon, ceil(n_k/n * blocks) * gamma) consecutive blocks, rotating."""

    epsilon: int = Field(ge=0, description="most blocks a client freezes")
    gamma: float = Field(1.0, ge=0.0, description="scales the size-proportional window")


class SharingConfig(_Section):
    """Which parameters are global (sent, aggregated), local (kept by each client) or frozen (not trained).

    Selectors: embeddings, head, 'block N', 'blocks A-B' (from 1), or 're:PATTERN' on parameter names.
    """

    critical_layer: int | None = Field(
        None, ge=0, description="FedSplitBERT c: embeddings + blocks 1..c global, the rest local (null: all global)")
    local: list[str] = Field(default_factory=list, description="selectors kept on each client")
    frozen: list[str] = Field(default_factory=list, description="selectors nobody trains or sends")
    freeze_window: FreezeWindowConfig | None = None
    local_store: Literal["auto", "memory", "disk"] = Field(
        "auto", description="where clients' local parameters live between rounds (auto: disk past 2 GB)")


class SplitConfig(_Section):
    """Federated split learning: clients keep the embeddings + ``bottom_blocks`` blocks and the last
    ``top_blocks`` blocks + head; a server trains the trunk in between (FedBERT: 0/0, FL-GLM: 1/1)."""

    bottom_blocks: int = Field(0, ge=0, description="blocks kept with the embeddings on the client")
    top_blocks: int = Field(0, ge=0, description="blocks kept with the head on the client")
    trunk_mode: Literal["sequential", "parallel", "client_batch"] = Field(
        "sequential", description="one trunk stepped by each client in turn | a trunk copy per client, averaged "
                                  "each round | every client's batch in one trunk step")
    client_parts: Literal["share", "average_bottom", "average", "local"] = Field(
        "average", description="client parts passed client to client (Head-Emd Share) | bottom averaged, top kept "
                               "(EmdAvg) | both averaged (Head-Emd Avg) | never shared")
    transport: Literal["inprocess", "grpc"] = Field(
        "inprocess", description="grpc: a loopback TLS trunk server, every message over the network stack")
    activation_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32", description="precision of the activations and gradients crossing the boundary (16 bits halve "
                               "its bytes; bfloat16 keeps float32's range, float16 three more bits of mantissa)")
    optimizer_state: Literal["reset", "carry"] = Field(
        "reset", description="reset: a fresh optimizer at every client turn, as FedAvg clients | carry: the trunk "
                             "keeps one optimizer across turns and rounds and, with client_parts: share, the "
                             "client parts travel with their optimizer state (one continuous training run, the "
                             "'logically centralized' Head-Emd Share); needs one trunk, not trunk_mode: parallel")


class EvalConfig(_Section):
    every: int = Field(1, ge=1, description="evaluate every k rounds (and always after the last)")
    local: bool = True
    batch_size: int = Field(64, ge=1)
    target: float | None = Field(None, description="report the bytes needed to first reach this headline score")
    headline: Literal["test", "local"] = Field(
        "test", description="score runs by the shared test split, or by the clients' means on their local splits")


class ExperimentConfig(_Section):
    name: str = "run"
    tags: dict[str, str] = Field(default_factory=dict, description="labels; a named grid axis writes its own here")
    seed: int = 0
    output_dir: str = "runs"
    task: Literal["auto", "mlm", "clm", "classification", "regression"] = "auto"
    data: DataConfig
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    protocol: ProtocolConfig = Field(default_factory=ProtocolConfig)
    sharing: SharingConfig = Field(default_factory=SharingConfig)
    split: SplitConfig | None = Field(None, description="set to train by federated split learning")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint_every: int = Field(1, ge=1)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    baselines: list[dict[str, Any]] = Field(
        default_factory=list, description="extra runs beside the grid, each a mapping of dotted overrides")
    downstream: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="after the run, fine-tune its saved model on each named task (dotted overrides of a fresh "
                    "config inheriting seed, output_dir, model.family and model.max_length)")

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if self.model.preset is None and self.model.checkpoint is None:
            raise ValueError("model: set model.preset (tiny/small/base) or model.checkpoint")
        if self.split is not None:
            if self.protocol.kind != "fedavg":
                raise ValueError(f"split learning averages with FedAvg; protocol.kind is {self.protocol.kind!r} "
                                 "(set protocol.kind: fedavg, or remove the split section)")
            if self.sharing != SharingConfig():
                raise ValueError("split.client_parts decides what clients share; remove the sharing section")
        return self


def _format_error(err: ValidationError) -> str:
    """One line for the first problem: the dotted key, the value given, and what is allowed."""
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "config"
    kind = first["type"]
    if kind == "extra_forbidden":
        parent = first["loc"][:-1]
        allowed = _allowed_keys(parent)
        return f"config error: unknown key '{key}' (allowed here: {', '.join(allowed)})"
    if kind == "missing":
        return f"config error: missing required key '{key}'"
    value = first.get("input")
    return f"config error: {key} = {value!r}: {first['msg']}"


def _allowed_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = ExperimentConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return sorted(model.model_fields)


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
        raise UserError(_format_error(err)) from None


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    raw = read_yaml(Path(path))
    for item in overrides:
        keys, value = parse_override(item)
        set_dotted(raw, keys, value)
    return validate(raw)


def is_named_axis(key: str) -> bool:
    """A grid key that is not a config key names an axis whose values are sets of overrides applied together
    (e.g. ``dataset: [{label: sst2, data.source: glue/sst2, partition.mixes: ...}, ...]``)."""
    return "." not in key and key not in ExperimentConfig.model_fields


def _axis_value(where: str, value: Any) -> tuple[dict[str, Any], str]:
    """(overrides, label) of one value of a named axis (``where`` = 'grid.<axis>') or of a baseline."""
    if not isinstance(value, dict):
        raise UserError(f"config error: {where} is a named axis (not a config key), so each value must be a "
                        f"mapping of dotted overrides, got {value!r}")
    if not isinstance(value.get("label", ""), str | int | float):
        raise UserError(f"config error: {where}: label must be a string, got {value['label']!r}")
    overrides = {k: v for k, v in value.items() if k != "label"}
    return overrides, str(value.get("label", _label(overrides)))


def expand_grid(config: ExperimentConfig) -> list[tuple[str, ExperimentConfig]]:
    """Every combination of the grid's values, each as (label, config); no grid -> the config itself."""
    if not config.grid and not config.baselines:
        return [("", config)]
    base = config.model_dump()
    base["grid"], base["baselines"] = {}, []
    keys = list(config.grid)
    runs = []
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*config.grid.values())]
    for choice in (combos if keys else []) + [{"": b} for b in config.baselines]:
        raw = copy.deepcopy(base)
        overrides: dict[str, Any] = {}
        labels: list[str] = []
        for key, value in choice.items():
            if key == "":  # a baseline: dotted overrides, optionally with a label
                baseline_overrides, baseline_label = _axis_value("baselines", value)
                overrides.update(baseline_overrides)
                labels.append(baseline_label)
            elif is_named_axis(key):
                axis_overrides, axis_label = _axis_value(f"grid.{key}", value)
                overrides.update(axis_overrides)
                raw.setdefault("tags", {})[key] = axis_label
                labels.append(f"{key}={axis_label}")
            else:
                overrides[key] = value
                labels.append(_label({key: value}))
        for key, value in overrides.items():
            set_dotted(raw, key.split("."), value)
        runs.append((",".join(labels), validate(raw)))
    return runs


def section_label(section: dict[str, Any]) -> str:
    """A section with a `kind` as a short label: 'label_dirichlet(alpha=1.0)' (num_clients left out)."""
    params = ",".join(f"{k}={v}" for k, v in section.items() if k not in ("kind", "num_clients"))
    kind = section.get("kind", "")
    return f"{kind}({params})" if params else str(kind)


def _label(overrides: dict[str, Any]) -> str:
    """A readable run label, e.g. 'partition=label_dirichlet(alpha=1.0),protocol=fedavg'."""
    parts = []
    for key, value in overrides.items():
        path = key.split(".")
        if isinstance(value, dict):
            parts.append(f"{key}={section_label(value)}")
        else:
            name = path[-2] if path[-1] == "kind" and len(path) > 1 else path[-1]
            parts.append(f"{name}={value}")
    return ",".join(parts)


def downstream_config(config: ExperimentConfig, name: str, checkpoint: str) -> ExperimentConfig:
    """The fine-tuning run ``name`` of ``config.downstream``, starting from the model saved at ``checkpoint``."""
    raw: dict[str, Any] = {
        "name": f"{config.name}[{name}]", "tags": dict(config.tags), "seed": config.seed,
        "output_dir": config.output_dir,
        "model": {"family": config.model.family, "checkpoint": checkpoint, "preset": None,
                  "max_length": config.model.max_length},
    }
    for key, value in config.downstream[name].items():
        set_dotted(raw, key.split("."), value)
    try:
        return ExperimentConfig.model_validate(raw)
    except ValidationError as err:
        raise UserError(_format_error(err).replace("config error:", f"config error in downstream.{name}:")) from None


def dump_config(config: ExperimentConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
