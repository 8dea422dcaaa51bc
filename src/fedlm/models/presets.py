"""Model size presets and how each family spells them in its HF config.

Presets are family-neutral (hidden size, depth, heads, MLP width, context length); the field-name
table below is the only place that knows, e.g., that GPT-2 calls the hidden size ``n_embd``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import (
    BertConfig,
    DistilBertConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    RobertaConfig,
)

from fedlm.errors import UserError

FAMILIES = ("bert", "roberta", "distilbert", "gpt2", "llama")
ENCODERS = ("bert", "roberta", "distilbert")
DECODERS = ("gpt2", "llama")


@dataclass(frozen=True)
class Preset:
    """Family-neutral architecture size."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden=64, layers=2, heads=2, intermediate=128, max_positions=256),
    "small": Preset(hidden=256, layers=4, heads=4, intermediate=1024, max_positions=512),
    "base": Preset(hidden=768, layers=12, heads=12, intermediate=3072, max_positions=512),
}

CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "bert": BertConfig,
    "roberta": RobertaConfig,
    "distilbert": DistilBertConfig,
    "gpt2": GPT2Config,
    "llama": LlamaConfig,
}

_STANDARD_FIELDS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "intermediate": "intermediate_size",
    "max_positions": "max_position_embeddings",
}

# Preset field -> HF config field, per family.
_FIELD_NAMES: dict[str, dict[str, str]] = {
    "bert": _STANDARD_FIELDS,
    "roberta": _STANDARD_FIELDS,
    "llama": _STANDARD_FIELDS,
    "distilbert": {
        "hidden": "dim",
        "layers": "n_layers",
        "heads": "n_heads",
        "intermediate": "hidden_dim",
        "max_positions": "max_position_embeddings",
    },
    "gpt2": {
        "hidden": "n_embd",
        "layers": "n_layer",
        "heads": "n_head",
        "intermediate": "n_inner",
        "max_positions": "n_positions",
    },
}

# Family conventions that differ from the HF config defaults.
_FAMILY_DEFAULTS: dict[str, dict] = {
    "roberta": {"type_vocab_size": 1},  # RoBERTa uses a single segment
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise UserError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")


def preset_config_kwargs(family: str, preset: Preset, pad_token_id: int | None) -> dict:
    """HF config kwargs for ``preset`` in ``family``'s field names."""
    check_family(family)
    sizes = asdict(preset)
    if family == "roberta" and pad_token_id is not None:
        # RoBERTa numbers positions from pad_token_id + 1, so it needs that many extra slots to fit
        # ``max_positions`` tokens (hence roberta-base's 514).
        sizes["max_positions"] += pad_token_id + 1
    names = _FIELD_NAMES[family]
    kwargs = {names[field]: value for field, value in sizes.items()}
    return {**kwargs, **_FAMILY_DEFAULTS.get(family, {})}


def check_overrides(family: str, overrides: dict) -> None:
    """Reject override keys the family's config does not have: HF would silently store typos."""
    known = CONFIG_CLASSES[family]()
    unknown = sorted(key for key in overrides if not hasattr(known, key))
    if unknown:
        raise UserError(f"unknown {family} config field(s) in model overrides: {', '.join(unknown)}")
