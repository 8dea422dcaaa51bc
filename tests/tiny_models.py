"""Tiny models for tests: fedlm's families at a chosen depth, and tiny random configs of other Hugging Face
families (GQA and sliding-window attention included) built straight from ``transformers``, with a random batch
and loss to push through them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

from fedlm.models.build import build_model

# The config field that holds the number of blocks, per fedlm family.
LAYER_FIELD = {"bert": "num_hidden_layers", "roberta": "num_hidden_layers", "distilbert": "n_layers",
               "gpt2": "n_layer", "llama": "num_hidden_layers"}


def tiny_model(family: str, task: str, tokenizer, layers: int = 2, seed: int = 0, **options) -> torch.nn.Module:
    """fedlm's ``tiny`` preset of ``family`` for ``task`` with ``layers`` blocks (``options``: build_model's)."""
    return build_model(family, "tiny", task, tokenizer, overrides={LAYER_FIELD[family]: layers}, seed=seed,
                       **options)


VOCAB, LAYERS = 61, 3
TINY = dict(
    hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=48, vocab_size=VOCAB,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64,
)
# What each family needs beyond TINY: GQA (fewer key/value heads than query heads) in every decoder that
# supports it, and a sliding window shorter than the batch so that windowed masks differ from full ones.
FAMILY_CONFIG: dict[str, dict] = {
    "bert": {},
    "roberta": {},
    "distilbert": {"hidden_dim": 48},
    "electra": {"embedding_size": 16},
    "gpt2": {"n_inner": 48},
    "llama": {"num_key_value_heads": 2},
    "mistral": {"num_key_value_heads": 1, "sliding_window": 4},
    "qwen2": {"num_key_value_heads": 2, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    "gemma3_text": {
        "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "phi3": {"num_key_value_heads": 2},
}
ENCODERS = ("bert", "roberta", "distilbert", "electra")
GQA = ("llama", "mistral", "qwen2", "gemma3_text", "phi3")
SEQ2SEQ = {"t5": {"num_decoder_layers": 2, "d_kv": 8}, "bart": {"decoder_layers": 2}}


def hf_config(family: str, **extra):
    """A tiny random config of any family in FAMILY_CONFIG or SEQ2SEQ."""
    return AutoConfig.for_model(family, **{**TINY, **FAMILY_CONFIG.get(family, {}), **SEQ2SEQ.get(family, {}), **extra})


def hf_model(family: str, task: str) -> torch.nn.Module:
    """A tiny random ``family`` model for ``task`` (lm, classification with 3 labels, seq2seq), in eval mode."""
    auto = {"lm": AutoModelForMaskedLM if family in ENCODERS else AutoModelForCausalLM,
            "classification": AutoModelForSequenceClassification, "seq2seq": AutoModelForSeq2SeqLM}[task]
    torch.manual_seed(0)
    return auto.from_config(hf_config(family, num_labels=3)).eval()  # eval: no dropout, so both paths agree


def random_batch(left_padding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of ids (of 9, 6 and 3 real tokens) and their attention mask."""
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    if left_padding:
        mask = mask.flip(1)
    return ids.masked_fill(mask == 0, 0), mask


def random_loss(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against fixed random targets: per row (classification) or per real token."""
    targets = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=torch.Generator().manual_seed(2))
    if logits.dim() == 2:  # sequence classification
        return F.cross_entropy(logits.float(), targets)
    keep = mask.bool()
    return F.cross_entropy(logits[keep].float(), targets[keep])
