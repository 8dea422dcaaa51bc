"""How much of the private text an attack recovered: token accuracy, BLEU-4 of the decoded text (sacrebleu),
and the precision / recall of a recovered set of token ids."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence, Set
from typing import Any

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from fedlm.errors import UserError


def require_sacrebleu() -> Any:
    """sacrebleu, or one line saying how to install it (it is the ``audit`` extra)."""
    try:
        import sacrebleu
    except ImportError:
        raise UserError("fedlm audit scores recovered text with BLEU-4 from sacrebleu, which is not installed; "
                        "pip install 'fedlm[audit]' (or pip install sacrebleu)") from None
    return sacrebleu


def token_accuracy(guess: Tensor, ids: Tensor, mask: Tensor) -> float:
    """Share of real-token positions whose id the attacker guessed exactly."""
    real = int(mask.sum())
    return float((guess[mask] == ids[mask]).sum()) / real if real else 0.0


def chance_accuracy(public_ids: Tensor, public_mask: Tensor, ids: Tensor, mask: Tensor) -> float:
    """The accuracy of an attacker who ignores the activations and always guesses the public text's most
    frequent token: the floor an inversion must beat to have learned anything."""
    counts = Counter(public_ids[public_mask].tolist())
    if not counts or not int(mask.sum()):
        return 0.0
    top = counts.most_common(1)[0][0]
    return float((ids[mask] == top).sum()) / int(mask.sum())


def decode_rows(tokenizer: PreTrainedTokenizerBase, ids: Tensor, mask: Tensor) -> list[str]:
    """Each sequence's real-token ids as text, special tokens dropped."""
    return [tokenizer.decode(row[keep].tolist(), skip_special_tokens=True) for row, keep in zip(ids, mask, strict=True)]


def bleu4(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU-4 (sacrebleu's default: 4-gram, exponential smoothing off, 13a tokenisation), 0-100."""
    sacrebleu = require_sacrebleu()
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def set_precision_recall(recovered: Set[int], true: Set[int]) -> dict[str, float | int]:
    """Precision and recall of a recovered token set against the true one (an empty recovered set has
    precision 1: it claims nothing false)."""
    hit = len(recovered & true)
    return {"precision": hit / len(recovered) if recovered else 1.0,
            "recall": hit / len(true) if true else 1.0,
            "recovered": len(recovered), "true": len(true), "correct": hit}
