"""Decoding for seq2seq evaluation: transformers' ``generate`` (greedy or beam search, no sampling) and the
plumbing around it that batches need.

A batch holds tensors only, so reference texts ride along as UTF-8 byte rows (exact: ROUGE must see the
untruncated reference, not a re-decoding of its possibly truncated, normalised token ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedlm.tasks.base import pad_ids


@dataclass(frozen=True)
class Decoding:
    """How evaluation decodes: ``num_beams`` 1 is greedy; ``max_new_tokens`` bounds every generated target."""

    num_beams: int = 1
    max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.num_beams < 1 or self.max_new_tokens < 1:
            raise ValueError(f"num_beams and max_new_tokens must be >= 1, got {self.num_beams}, {self.max_new_tokens}")


def texts_to_bytes(texts: Sequence[str]) -> torch.Tensor:
    """Texts as a (batch, longest) uint8 tensor of their UTF-8 bytes, zero-padded (text holds no NUL here)."""
    return pad_ids([list(text.encode("utf-8")) for text in texts], 0)[0].to(torch.uint8)


def bytes_to_texts(rows: torch.Tensor) -> list[str]:
    """Inverse of :func:`texts_to_bytes`."""
    return [bytes(row[row != 0].tolist()).decode("utf-8") for row in rows.cpu()]


def left_pad(sequences: Sequence[Sequence[int]], pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask: a decoder continues every prompt of a batch from the same last column."""
    ids, mask = pad_ids([list(reversed(seq)) for seq in sequences], pad_value)
    return ids.flip(1), mask.flip(1)


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    decoding: Decoding,
    stop_ids: tuple[int, ...] = (),
) -> list[str]:
    """Generated texts for a batch of (left-padded, for a decoder-only model) prompts, special tokens removed.

    A decoder-only model's output repeats its prompt; only the continuation is decoded. Generation stops at
    end-of-text, at any of ``stop_ids`` (a chat template's end-of-turn token), or after ``max_new_tokens``; the
    model's own generation defaults (sampling, penalties, a checkpoint's ``min_length``) are overridden so that
    decoding is exactly greedy or beam search."""
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=decoding.max_new_tokens,
        min_length=0,
        num_beams=decoding.num_beams,
        do_sample=False,
        early_stopping=decoding.num_beams > 1,
        no_repeat_ngram_size=0,
        repetition_penalty=1.0,
        length_penalty=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, *stop_ids] if stop_ids else tokenizer.eos_token_id,
    )
    if not model.config.is_encoder_decoder:
        out = out[:, input_ids.shape[1]:]
    return tokenizer.batch_decode(out, skip_special_tokens=True)
