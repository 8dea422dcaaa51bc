"""Model size presets and how each family spells them in its HF config.

Presets are family-neutral (hidden size, depth, heads, MLP width, context length). Any family
``transformers`` knows gets them: its config class comes from ``transformers.CONFIG_MAPPING`` and the field
names from the config's own ``attribute_map`` (GPT-2 maps ``hidden_size`` to ``n_embd``), plus the few
spellings of the MLP width HF configs use (:func:`field_names`). ``FAMILIES`` / ``ENCODERS`` / ``DECODERS``
name the families with a trained-tokenizer recipe and tests of every task; others work from a checkpoint,
or from a preset with a tokenizer that exists for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import (
    CONFIG_MAPPING,
    BartConfig,
    BertConfig,
    DistilBertConfig,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    RobertaConfig,
    T5Config,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

from fedlm.errors import UserError

FAMILIES = ("bert", "roberta", "distilbert", "gpt2", "llama")  # one stack of blocks: every task, split learning
ENCODERS = ("bert", "roberta", "distilbert")
DECODERS = ("gpt2", "llama")
ENCODER_DECODERS = ("t5", "bart")  # seq2seq only (AutoModelForSeq2SeqLM); no split learning


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
    "t5": T5Config,
    "bart": BartConfig,
}

_STANDARD_FIELDS = {
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "max_positions": "max_position_embeddings",
}
# How HF configs spell the MLP width (llama & co, GPT-2, DistilBERT, T5, BART / OPT); the first one the
# family's config has is used.
_INTERMEDIATE = ("intermediate_size", "n_inner", "hidden_dim", "d_ff", "encoder_ffn_dim", "ffn_dim")


def config_class(family: str) -> type[PretrainedConfig]:
    """The family's HF config class; one line for a family ``transformers`` does not know."""
    check_family(family)
    return CONFIG_CLASSES.get(family) or CONFIG_MAPPING[family]


def field_names(family: str) -> dict[str, str]:
    """Preset field -> the family's own HF config field (a preset field the family has no slot for, such as
    T5's position table, is left out)."""
    cls = config_class(family)
    default = cls()
    names = {field: cls.attribute_map.get(name, name) for field, name in _STANDARD_FIELDS.items()}
    names = {field: name for field, name in names.items() if hasattr(default, name)}
    intermediate = next((name for name in _INTERMEDIATE if hasattr(default, name)), None)
    if intermediate is not None:
        names["intermediate"] = intermediate
    return names


def is_decoder_family(family: str) -> bool:
    """A causal LM and no masked LM (gpt2, llama, mistral, gemma3 ...), by transformers' own auto mappings."""
    return family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and family not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def is_encoder_decoder_family(family: str) -> bool:
    """t5, bart and any family transformers has a seq2seq LM class for (mt5, pegasus, mbart ...)."""
    return family in ENCODER_DECODERS or family in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES


def is_encoder_family(family: str) -> bool:
    """A masked LM and no seq2seq LM (bert, electra, modernbert, deberta-v2 ...; not bart or mbart), by
    transformers' own auto mappings."""
    return family in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not is_encoder_decoder_family(family)


# Encoder-decoder families: the decoder stack is sized like the encoder (preset field -> decoder's HF field).
_DECODER_FIELDS: dict[str, dict[str, str]] = {
    "t5": {"layers": "num_decoder_layers"},
    "bart": {"layers": "decoder_layers", "heads": "decoder_attention_heads", "intermediate": "decoder_ffn_dim"},
}

# Which special token the decoder starts from (the families' published checkpoints: T5 pad, BART end-of-text).
DECODER_START: dict[str, str] = {"t5": "pad_token_id", "bart": "eos_token_id"}

# Families that number positions from pad_token_id + 1 (RoBERTa's embeddings and their copies).
POSITIONS_AFTER_PAD = ("roberta", "xlm-roberta", "camembert")

# Family conventions that differ from the HF config defaults.
_FAMILY_DEFAULTS: dict[str, dict] = {
    "roberta": {"type_vocab_size": 1},  # RoBERTa uses a single segment
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def check_family(family: str) -> None:
    """Any ``model_type`` transformers knows (bert, gpt2, llama, mistral, qwen2, gemma3_text, phi3, ...)."""
    if family not in CONFIG_MAPPING:
        raise UserError(f"unknown model family {family!r}: use a transformers model_type, e.g. "
                        f"{', '.join(FAMILIES + ENCODER_DECODERS)}, mistral, qwen2, gemma3_text, phi3")


def preset_config_kwargs(family: str, preset: Preset, pad_token_id: int | None) -> dict:
    """HF config kwargs for ``preset`` in ``family``'s field names."""
    check_family(family)
    _check_one_stack(family)
    sizes = asdict(preset)
    if family in POSITIONS_AFTER_PAD and pad_token_id is not None:
        # RoBERTa numbers positions from pad_token_id + 1, so it needs that many extra slots to fit
        # ``max_positions`` tokens (hence roberta-base's 514).
        sizes["max_positions"] += pad_token_id + 1
    names = field_names(family)
    kwargs = {names[field]: value for field, value in sizes.items() if field in names}
    default = config_class(family)()
    if hasattr(default, "num_key_value_heads"):  # plain multi-head attention; GQA through overrides
        kwargs["num_key_value_heads"] = preset.heads
    settable = "head_dim" not in type(default).attribute_map and not isinstance(
        getattr(type(default), "head_dim", None), property)  # Falcon derives it from the width
    if settable and getattr(default, "head_dim", None) is not None:
        # families that size heads on their own (Gemma's default is 256 whatever the width)
        kwargs["head_dim"] = preset.hidden // preset.heads
    kwargs.update({name: sizes[field] for field, name in _DECODER_FIELDS.get(family, {}).items()})
    if family == "t5":  # T5 sizes attention heads separately (d_kv); the other families divide the width
        kwargs["d_kv"] = preset.hidden // preset.heads
    return {**kwargs, **_FAMILY_DEFAULTS.get(family, {})}


def _check_one_stack(family: str) -> None:
    """A preset sizes one stack of blocks by its width and depth; a composite config (gemma3's text and vision
    towers) has neither field, and would otherwise build at its full default size."""
    names = field_names(family)
    if "hidden" in names and "layers" in names:
        return
    parts = getattr(config_class(family), "sub_configs", None) or {}
    text = getattr(parts.get("text_config"), "model_type", None)
    instead = f"model.family: {text} (its text model)" if text else "a model.checkpoint"
    raise UserError(f"model.preset sizes one stack of blocks, and a {family} config has no width and depth of its "
                    f"own{' (its parts: ' + ', '.join(parts) + ')' if parts else ''}; use {instead}")


def check_overrides(family: str, overrides: dict) -> None:
    """Reject override keys the family's config does not have: HF would silently store typos."""
    known = config_class(family)()
    unknown = sorted(key for key in overrides if not hasattr(known, key))
    if unknown:
        raise UserError(f"unknown {family} config field(s) in model overrides: {', '.join(unknown)}")
