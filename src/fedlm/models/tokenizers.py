"""Train a family-appropriate tokenizer from raw text with the `tokenizers` library.

Recipes follow each family's own published tokenizer so that a locally trained tokenizer has the same
special tokens, pair format and model inputs as one loaded from a checkpoint of that family:

* bert / distilbert: uncased WordPiece, ``[CLS] A [SEP] B [SEP]``; only BERT feeds ``token_type_ids``.
* roberta: byte-level BPE with ``<s> A </s></s> B </s>``, as RoBERTa itself does. Choosing it over
  WordPiece keeps the trained and the pretrained RoBERTa paths identical (no ``[UNK]``, no segments).
* gpt2 / llama: byte-level BPE plus a dedicated ``<pad>`` token, so padding never aliases end-of-text.
* t5: a unigram model over whitespace-marked pieces (what SentencePiece trains), ``$A </s>``, pad = 0.
* bart: RoBERTa's byte-level BPE and ``<s> $A </s>`` (BART reuses RoBERTa's vocabulary).

Any other family borrows one of these by its kind (:func:`recipe_for`): a decoder-only family (qwen2, mistral,
gemma3_text, phi3, opt, olmo2 ...) llama's byte-level BPE, an encoder-only one (electra, modernbert,
deberta-v2, xlm-roberta ...) BERT's WordPiece, so that a preset alone pre-trains any of them from scratch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from fedlm.models.presets import config_class, is_decoder_family, is_encoder_decoder_family, is_encoder_family

# Part of the tokenizer cache key: bump when a recipe changes so stale cached tokenizers are not reused.
RECIPE_VERSION = 2  # 2: unigram's appended characters in a fixed order (_canonical_order)


@dataclass(frozen=True)
class Recipe:
    """How to build one family's tokenizer."""

    wordpiece: bool
    roles: dict[str, str]  # HF special-token role -> token; first occurrence order fixes the ids
    single: str
    pair: str
    input_names: tuple[str, ...] = ("input_ids", "attention_mask")
    unigram: bool = False  # T5's SentencePiece-style unigram model instead of BPE / WordPiece


_BERT_ROLES = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}
_BERT_INPUTS = ("input_ids", "token_type_ids", "attention_mask")
_BERT_TEMPLATES = {"single": "[CLS] $A [SEP]", "pair": "[CLS] $A [SEP] $B:1 [SEP]:1"}

_ROBERTA_ROLES = {
    "bos_token": "<s>",
    "pad_token": "<pad>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
    "cls_token": "<s>",
    "sep_token": "</s>",
}

RECIPES: dict[str, Recipe] = {
    "bert": Recipe(True, _BERT_ROLES, **_BERT_TEMPLATES, input_names=_BERT_INPUTS),
    "distilbert": Recipe(True, _BERT_ROLES, **_BERT_TEMPLATES),
    "roberta": Recipe(False, _ROBERTA_ROLES, single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>"),
    "bart": Recipe(False, _ROBERTA_ROLES, single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>"),
    "t5": Recipe(
        False,
        {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"},
        single="$A </s>",
        pair="$A </s> $B </s>",
        unigram=True,
    ),
    "gpt2": Recipe(
        False,
        {**dict.fromkeys(("bos_token", "eos_token", "unk_token"), "<|endoftext|>"), "pad_token": "<pad>"},
        single="$A",
        pair="$A <|endoftext|> $B:1",
    ),
    "llama": Recipe(
        False,
        {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        single="<s> $A",
        pair="<s> $A </s> $B:1",
    ),
}


def recipe_for(family: str) -> str | None:
    """The recipe that trains ``family``'s tokenizer: its own, else by its kind in transformers' auto mappings
    (a decoder-only family llama's byte-level BPE, with ``<s>`` first and a ``<pad>`` of its own; an encoder-only
    one BERT's WordPiece, with segments only where its config has a segment table to read them); None for the
    rest (encoder-decoders other than t5 and bart), which need a checkpoint's tokenizer."""
    if family in RECIPES:
        return family
    if is_encoder_decoder_family(family):
        return None
    if is_decoder_family(family):
        return "llama"
    if is_encoder_family(family):
        return "bert" if (getattr(config_class(family)(), "type_vocab_size", 0) or 0) >= 2 else "distilbert"
    return None


def train_tokenizer(texts: Sequence[str], family: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Train ``family``'s recipe (:func:`recipe_for`) on ``texts``; deterministic for a given input."""
    recipe = RECIPES[recipe_for(family) or family]
    specials = list(dict.fromkeys(recipe.roles.values()))
    train = _unigram if recipe.unigram else _wordpiece if recipe.wordpiece else _byte_bpe
    tokenizer = train(specials, vocab_size, texts)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=recipe.single,
        pair=recipe.pair,
        special_tokens=[(token, tokenizer.token_to_id(token)) for token in specials],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, model_input_names=list(recipe.input_names), **recipe.roles
    )


def _wordpiece(specials: list[str], vocab_size: int, texts: Sequence[str]) -> Tokenizer:
    normalizer = normalizers.BertNormalizer(lowercase=True)
    # The trainer numbers "##x" continuation tokens in hash-map order, so merge ties break differently
    # from run to run (huggingface/tokenizers#1794). Registering every "##x" up front as a trainer special
    # fixes their ids; the final tokenizer below keeps them as ordinary vocabulary entries.
    chars = sorted({char for text in texts for char in normalizer.normalize_str(text) if not char.isspace()})
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=specials + [f"##{char}" for char in chars], show_progress=False
    )
    scratch = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")), normalizer)
    scratch.train_from_iterator(texts, trainer)
    vocab = scratch.get_vocab()
    tokenizer = _bert_pipeline(Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")), normalizer)
    tokenizer.add_special_tokens(specials)
    return tokenizer


def _bert_pipeline(tokenizer: Tokenizer, normalizer: normalizers.Normalizer) -> Tokenizer:
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def _byte_bpe(specials: list[str], vocab_size: int, texts: Sequence[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def _unigram(specials: list[str], vocab_size: int, texts: Sequence[str]) -> Tokenizer:
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size, special_tokens=specials, unk_token="<unk>", show_progress=False
    )
    scratch = _unigram_pipeline(Tokenizer(models.Unigram()))
    scratch.train_from_iterator(texts, trainer)
    # The trainer's scores differ from run to run in their last bits (float sums in varying order), and it
    # orders equal scores in hash-map order: round the scores and renumber the pieces by (score, piece)
    # after the specials, so that the same texts always give the same ids.
    pieces = [(piece, round(score, 9)) for piece, score in json.loads(scratch.to_str())["model"]["vocab"]]
    rest = _canonical_order([p for p in pieces if p[0] not in specials])
    vocab = [next(p for p in pieces if p[0] == s) for s in specials] + rest
    return _unigram_pipeline(Tokenizer(models.Unigram(vocab, unk_id=specials.index("<unk>"))))


APPENDED_SCORE_STEP = 1e-4  # the unigram trainer's score step between the characters it appends


def _canonical_order(pieces: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """``pieces`` sorted by (score, piece), after one repair: the trainer appends the characters that pruning
    dropped in hash-set order (a new order in every process), scoring them in steps of 1e-4 near the lowest
    score, so their scores follow that order. Find that block (the longest run of single characters whose scores
    step by 1e-4) and pair its characters with its scores in sorted order; a learned single character tied with
    one of those scores joins the block, which is harmless (the pairs stay the same multiset)."""
    scores = sorted({score for piece, score in pieces if len(piece) == 1}, reverse=True)
    best, start = (0, 0), 0
    for end in range(1, len(scores) + 1):
        if end == len(scores) or not math.isclose(scores[end - 1] - scores[end], APPENDED_SCORE_STEP, abs_tol=1e-8):
            best, start = max(best, (start, end - 1), key=lambda run: run[1] - run[0]), end
    if best[1] > best[0]:
        low, high = scores[best[1]], scores[best[0]]
        in_block = [len(piece) == 1 and low <= score <= high for piece, score in pieces]
        block = [entry for entry, inside in zip(pieces, in_block, strict=True) if inside]
        rest = [entry for entry, inside in zip(pieces, in_block, strict=True) if not inside]
        pieces = [*rest, *zip(sorted(piece for piece, _ in block), sorted((score for _, score in block), reverse=True),
                              strict=True)]
    return sorted(pieces, key=lambda entry: (-entry[1], entry[0]))


def _unigram_pipeline(tokenizer: Tokenizer) -> Tokenizer:
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return tokenizer
