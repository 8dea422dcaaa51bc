"""The typed sections of an experiment config (all but partition, which has a kind per partitioner)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from fedlm.config.protocol_kinds import PROTOCOL_KINDS, ProtocolKind


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    source: str = Field(description="named dataset (e.g. glue/sst2) or a local file/directory path")
    columns: dict[str, str] | None = Field(
        None, description="role -> the data's column: text, text_pair, label, target (seq2seq), group (the silo "
                          "of each row, for partition.kind natural; partition.column fills it in); task chat: "
                          "messages, or text / target as prompt / response")
    format: Literal["csv", "tsv", "jsonl", "json", "txt", "parquet"] | None = None
    chat_template: Literal["auto", "tokenizer", "plain", "alpaca"] = Field(
        "auto", description="task chat: how conversations are rendered; auto: the tokenizer's own chat template "
                            "when it has one, else plain (### User: / ### Assistant: blocks); alpaca: ### "
                            "Instruction: / ### Response: blocks")
    test_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    validation_fraction: float | None = Field(
        None, gt=0.0, le=0.5, description="share of the training split held out (drawn with the seed, before "
                                          "partitioning) as the server's validation set, for a source without one "
                                          "of its own; scored at every evaluation (val_* metrics): what eval.select: "
                                          "best and a learning-rate choice read, so the test split stays unseen")
    max_train_examples: int | None = Field(None, ge=1)
    max_test_examples: int | None = Field(None, ge=1)
    _implied: set[str] = PrivateAttr(default_factory=set)  # column roles another section filled in

    def imply_column(self, role: str, column: str) -> None:
        """Load ``column`` as ``role`` because another section names it (a natural partition's column): it is
        loaded, but not dumped, so a dumped config says what was written and validates to the same again."""
        self.columns = {**(self.columns or {}), role: column}
        self._implied.add(role)

    def written_column(self, role: str) -> str | None:
        """The column the config itself maps ``role`` to (not one implied by another section)."""
        return None if role in self._implied else (self.columns or {}).get(role)

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped = handler(self)
        if self._implied and dumped.get("columns"):
            dumped["columns"] = {k: v for k, v in dumped["columns"].items() if k not in self._implied} or None
        return dumped


class ModelConfig(Section):
    family: str = Field("bert", description="a transformers model_type: any encoder-only or decoder-only family "
                        "trains from a preset with a tokenizer fedlm trains (t5, bart too); other encoder-decoders "
                        "need a checkpoint for their tokenizer")
    preset: Literal["tiny", "small", "base"] | None = "tiny"
    checkpoint: str | None = Field(None, description="'minilm', a local directory, or a hub name")
    vocab_size: int = Field(8000, ge=100)
    max_length: int = Field(128, ge=8, le=4096)
    doc_stride: int = Field(32, ge=0, description="qa: context tokens shared by consecutive windows of a long "
                                                  "context (an answer cut by one window's edge is whole in the next)")
    pooling: Literal["auto", "first", "mean"] = Field(
        "auto", description="classification / regression: what the head reads. first: the family's own (first "
                            "token, last for decoders); mean: the mean of the token states (encoders); auto: mean "
                            "for a sentence-transformers checkpoint that pools by mean (e.g. minilm), else first")
    overrides: dict[str, Any] = Field(default_factory=dict)
    quantization: QuantizationConfig | None = Field(
        None, description="load the checkpoint's base in 4 or 8 bits through bitsandbytes (QLoRA: an adapter "
                          "trains on it; pip install 'fedlm[qlora]')")


class QuantizationConfig(Section):
    """A quantized, frozen base (bitsandbytes): its packed weights neither train nor travel."""

    bits: Literal[4, 8] = 4
    type: Literal["nf4", "fp4"] = Field("nf4", description="4 bits: NormalFloat4 (QLoRA's) or plain FP4")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="4 bits: the dtype the layers compute in (bfloat16 on GPUs that have it)")
    double_quant: bool = Field(False, description="4 bits: quantize the quantization constants too")


class TrainConfig(Section):
    """Local training on one client (or on the pooled data, for centralized)."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(5e-4, gt=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="the learning rate over the rounds (centralized: epochs), constant within a "
                                "round: linear falls from lr in round 1 to lr/R in round R of R; cosine from lr to "
                                "near 0 on a half cosine")
    weight_decay: float = Field(0.0, ge=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    batch_size: int = Field(16, ge=1)
    local_epochs: int = Field(1, ge=1)
    local_steps: int | None = Field(None, ge=1, description="if set, overrides local_epochs")
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    group_by_length: bool = Field(False, description="batch examples of similar length together (shuffled "
                                  "groups, as transformers' group_by_length): far less padding on short texts; "
                                  "DP-SGD clients (privacy.kind sample) keep plain shuffles")
    mask_rate: float = Field(0.15, gt=0.0, lt=1.0, description="masked LM: share of tokens a training step "
                             "predicts (evaluation always masks 15%); 0.4 trains small models faster")
    device: str = Field("auto", description="auto (CUDA if present, else MPS, else CPU) | cpu | cuda | cuda:N | mps: "
                                            "where the model, a split run's trunk and its client parts compute")
    gradient_checkpointing: bool = Field(
        False, description="recompute block activations in the backward pass: less memory, ~30% more compute "
                           "(clients, split parts and the trunk alike)")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="autocast for training and evaluation: fp32 (none) | bf16 | fp16 (with loss scaling; "
                            "not for split runs); parameters, what is sent and the server's average stay fp32")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", value):
            raise ValueError("should be auto, cpu, cuda, cuda:N (N a device index) or mps")
        return value


class ProtocolConfig(Section):
    kind: Literal["centralized", "isolated", "fedavg", "fedprox", "fedopt"] = "fedavg"  # PROTOCOL_KINDS' keys
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
    aggregator: Literal["mean", "median", "trimmed_mean", "krum", "norm_bound"] = Field(
        "mean", description="how the round's updates become one: FedAvg's weighted mean, or a robust rule "
        "(coordinate median, trimmed mean, Multi-Krum, norm bounding) that fedprox / fedopt build on alike")
    trim_beta: float = Field(0.1, ge=0.0, lt=0.5, description="trimmed_mean: share of values cut at each end")
    krum_f: int = Field(1, ge=0, description="krum: malicious clients tolerated (needs clients per round > 2f + 2)")
    krum_m: int = Field(1, ge=1, description="krum: updates kept and averaged (1: Krum, more: Multi-Krum)")
    norm_bound: float | None = Field(
        None, gt=0.0, description="norm_bound: each update's change scaled to at most this L2 norm (null: the "
        "round's median change norm)")
    max_update_growth: float | None = Field(
        1000.0, gt=1.0, description="refuse a report with a tensor this many times the global model's scale "
        "(root mean square, at least 0.01): a scaled-up attack or a broken client; null: accept any finite report")
    codec: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    codec_block_size: int | None = Field(
        None, ge=1, description="int8: one absmax scale per block of this many values (null: one per tensor)")

    @property
    def traits(self) -> ProtocolKind:
        """What this kind of protocol means beyond its strategy (pools data, shares nothing, counts bytes, ...)."""
        return PROTOCOL_KINDS[self.kind]

    @model_validator(mode="after")
    def _block_size_needs_int8(self) -> ProtocolConfig:
        if self.codec_block_size is not None and self.codec != "int8":
            raise ValueError(f"codec_block_size is for codec int8 (codec is {self.codec}); remove it or use int8")
        if self.aggregator != "mean" and not self.traits.averages_updates:
            raise ValueError(f"aggregator {self.aggregator} combines several clients' updates, and kind "
                             f"{self.kind} has none to combine; use kind fedavg, fedprox or fedopt")
        return self


ADAPTER_KEYS = {"lora": {"r", "alpha", "dropout", "target_modules", "save_merged"},
                "ia3": {"target_modules", "feedforward_modules", "save_merged"},
                "prefix": {"prefix_length", "projection", "projection_size"},
                "p_tuning_v2": {"prefix_length"}}


class AdapterConfig(Section):
    """Parameter-efficient fine-tuning (peft): only the adapter (and the task head, if ``train_head``) trains
    and travels; the base model stays frozen. ``prefix`` reparameterises its prefixes through an MLP
    (``projection``), ``p_tuning_v2`` trains them directly."""

    kind: Literal["lora", "prefix", "p_tuning_v2", "ia3"]
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: float = Field(16.0, gt=0.0, description="LoRA scale numerator: the update is (alpha / r) B A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout on the adapter's input")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="module names (suffixes) to adapt, or all-linear (every linear layer in the blocks); "
                          "null: peft's default for the family, else all-linear")
    feedforward_modules: list[str] | None = Field(None, description="IA3: which targets scale their input (MLP)")
    prefix_length: int = Field(16, ge=1, description="virtual tokens prepended to every block's keys/values")
    projection: bool = Field(True, description="prefix: produce the prefixes by an MLP from a smaller embedding")
    projection_size: int | None = Field(None, ge=1, description="prefix: the MLP's hidden width (null: model width)")
    train_head: bool | None = Field(None, description="also train (and send) the task head; null: yes for "
                                                      "classification, regression, tagging and qa, no for "
                                                      "language modelling (tied heads)")
    save_merged: bool = Field(False, description="also save the base with the adapter merged in (model/merged)")

    @model_validator(mode="after")
    def _keys_of_kind(self) -> AdapterConfig:
        allowed = ADAPTER_KEYS[self.kind] | {"kind", "train_head"}
        # keys left at their defaults pass, so a dumped config (every key written out) validates again
        stray = sorted(name for name, spec in type(self).model_fields.items()
                       if name not in allowed and getattr(self, name) != spec.default)
        if stray:
            raise ValueError(f"{', '.join(stray)} not used by adapter.kind {self.kind} (its keys: "
                             f"{', '.join(sorted(allowed))})")
        return self


class FreezeWindowConfig(Section):
    """FFDAPT: client k freezes min(epsilon, ceil(n_k/n * blocks) * gamma) consecutive blocks, rotating."""

    epsilon: int = Field(ge=0, description="most blocks a client freezes")
    gamma: float = Field(1.0, ge=0.0, description="scales the size-proportional window")


class SharingConfig(Section):
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


class SplitConfig(Section):
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


class PrivacyConfig(Section):
    """Differential privacy: client level (DP-FedAvg: each client's update clipped, noise on the server's sum) or
    sample level (DP-SGD inside each client, through Opacus); epsilon at ``delta`` is reported every round."""

    kind: Literal["none", "client", "sample"] = Field(
        "none", description="none | client (protects a client's whole contribution) | sample (one example's)")
    noise_multiplier: float = Field(1.0, ge=0.0, description="z: the Gaussian noise's std in units of the clipping "
                                                             "norm (0: clipping only, epsilon unbounded)")
    clip: float = Field(1.0, gt=0.0, description="client: C, the L2 bound of one client's update (over the "
                                                 "parameters that travel)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="sample: the L2 bound of one example's gradient")
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="the delta epsilon is reported at")
    accountant: Literal["rdp", "prv"] = Field("rdp", description="Opacus' accountant: rdp (Renyi DP) | prv (PRV)")


class GenerationConfig(Section):
    """Decoding for seq2seq evaluation (transformers' ``generate``, no sampling)."""

    num_beams: int = Field(1, ge=1, description="1: greedy decoding; more: beam search with this many beams")
    max_new_tokens: int = Field(
        64, ge=1, description="length limit of a generated target; training targets are cut to it too, since "
                              "tokens past it could never be produced")


class EvalConfig(Section):
    every: int = Field(1, ge=1, description="evaluate every k rounds (and always after the last)")
    start: bool = Field(True, description="score the starting model as round 0; off where another run of the "
                                          "grid scores the same start on the same test items (an LLM's "
                                          "evaluation can cost as much as its training)")
    local: bool = True
    batch_size: int = Field(64, ge=1)
    target: float | None = Field(None, description="report the bytes needed to first reach this headline score")
    headline: Literal["test", "local"] = Field(
        "test", description="score runs by the shared test split, or by the clients' means on their local splits")
    select: Literal["last", "best"] = Field(
        "last", description="the model a run delivers: the last round's, or (best) the evaluated round's with the "
                            "best validation headline -- its test scores are the run's final ones and its weights "
                            "the saved model; the source's own validation split, else data.validation_fraction's")
    max_answer_length: int = Field(30, ge=1, description="qa: the longest answer span predicted, in tokens")
    metrics: list[str] | None = Field(
        None, description="the metrics reported (the headline always): multiple_choice of acc, acc_norm, loss, "
                          "perplexity (default all); seq2seq and chat of loss, perplexity, rouge1, rouge2, rougeL, "
                          "exact_match, f1 (default loss and ROUGE)")
    equivalence_band: float | None = Field(
        None, gt=0, description="a grid's equivalence margin in the headline metric's units (accuracy 0.01 = one "
                                "point), fixed before the runs: comparison.md then calls two settings equivalent "
                                "only when the whole 95% interval of their same-seed difference lies inside ±band")


class AttackConfig(Section):
    """Malicious clients, so a defence is measured rather than claimed: what they do (fedlm.federation.attacks)
    and who they are. The attack is the clients' own doing, in simulation and on a Flower node alike."""

    kind: Literal["none", "scale", "sign_flip", "noise", "label_flip", "backdoor"] = Field(
        "none", description="scale | sign_flip | noise (what a client uploads) | label_flip | backdoor (its data)")
    fraction: float = Field(0.0, ge=0.0, lt=1.0, description="share of the clients that attack, drawn with the seed")
    clients: list[int] | None = Field(None, description="the attacking client ids (instead of fraction)")
    scale: float | None = Field(None, gt=0.0, description="scale: the change times this (default 10); sign_flip: "
                                                          "times minus this (default 1)")
    noise_std: float = Field(1.0, gt=0.0, description="noise: the std of the noise sent in place of the change")
    trigger: str = Field("cf mn bb", min_length=1, description="backdoor: the phrase put into poisoned examples")
    target_label: int = Field(0, ge=0, description="backdoor: the label poisoned examples get")
    poison_share: float = Field(0.5, gt=0.0, le=1.0, description="backdoor: share of an attacker's examples "
                                                                 "poisoned")

    @model_validator(mode="after")
    def _someone_attacks(self) -> AttackConfig:
        if self.kind != "none" and self.clients is None and self.fraction == 0:
            raise ValueError(f"kind {self.kind} needs attackers: set fraction (in (0, 1)) or clients")
        if self.clients is not None and (not self.clients or min(self.clients) < 0):
            raise ValueError(f"clients = {self.clients}: give client ids >= 0, or use fraction")
        return self

    def factor(self) -> float:
        """The multiplier of scale / sign_flip (their defaults differ: boosting vs. a plain flip)."""
        return self.scale if self.scale is not None else (10.0 if self.kind == "scale" else 1.0)
