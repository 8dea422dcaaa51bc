"""Masked language modelling with the vocabulary projection computed only at masked positions.

Only ~15% of tokens carry a target, yet the stock HF heads project every position onto the vocabulary
(the single largest matmul for small models). Running the encoder, gathering the selected rows and
applying the family's own head modules to just those rows gives the same loss for a fraction of the cost.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fedlm.errors import UserError
from fedlm.models.heads import mlm_head
from fedlm.tasks.base import IGNORE_INDEX, Batch, TokenPredictionTask, pad_ids

SELECT_PROB = 0.15  # BERT's rate; evaluation always uses it, so perplexities compare across training rates
MASK_PROB = 0.8  # of selected tokens: replaced by the mask token
RANDOM_PROB = 0.1  # of selected tokens: replaced by a random token; the rest keep their own


def mask_tokens(
    input_ids: torch.Tensor,
    maskable: torch.Tensor,
    mask_token_id: int,
    replacement_ids: torch.Tensor,
    generator: torch.Generator,
    select_prob: float = SELECT_PROB,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: select ``select_prob`` of ``maskable`` tokens, then 80% mask / 10% random / 10% keep.

    Returns (corrupted input ids, labels with ``IGNORE_INDEX`` at unselected positions).
    """
    selected = (torch.rand(input_ids.shape, generator=generator) < select_prob) & maskable
    action = torch.rand(input_ids.shape, generator=generator)
    to_mask = selected & (action < MASK_PROB)
    to_random = selected & (action >= MASK_PROB) & (action < MASK_PROB + RANDOM_PROB)
    picks = torch.randint(len(replacement_ids), (int(to_random.sum()),), generator=generator)
    corrupted = input_ids.masked_fill(to_mask, mask_token_id)
    corrupted[to_random] = replacement_ids[picks]
    labels = input_ids.masked_fill(~selected, IGNORE_INDEX)
    return corrupted, labels


class MaskedLMTask(TokenPredictionTask):
    """Masked LM; masking is drawn in ``collate`` so it is reproducible per generator seed.

    ``mask_rate`` is the share of tokens a training step predicts. Evaluation always masks BERT's 15%, so
    test perplexities of runs trained at different rates compare (Wettig et al. 2022, "Should You Mask 15%
    in Masked Language Modeling?": 40% trains faster, most of all for small models).
    """

    name = "mlm"
    default_mask_rate = SELECT_PROB

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None, mask_rate: float = SELECT_PROB, *,
                 precision: str = "fp32") -> None:
        if not 0.0 < mask_rate < 1.0:
            raise UserError(f"mask_rate {mask_rate} is not a share of tokens: choose a value in (0, 1), e.g. 0.15")
        self.mask_rate = mask_rate
        super().__init__(tokenizer, precision=precision)

    def bind(self, tokenizer: PreTrainedTokenizerBase) -> MaskedLMTask:
        if tokenizer.mask_token_id is None:
            raise UserError("masked LM needs a tokenizer with a mask token")
        super().bind(tokenizer)
        self._special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
        vocab = torch.arange(len(tokenizer))
        # Random replacements come from ordinary tokens only: never inject [CLS]/[PAD]/... mid-text.
        self._replacement_ids = vocab[~torch.isin(vocab, self._special_ids)]
        return self

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        return self._masked(rows, generator, self.mask_rate)

    def eval_collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        return self._masked(rows, generator, SELECT_PROB)

    def _masked(self, rows: list[dict], generator: torch.Generator, rate: float) -> Batch:
        tokenizer = self.bound_tokenizer
        ids, attention_mask = pad_ids([row["input_ids"] for row in rows], tokenizer.pad_token_id)
        maskable = attention_mask.bool() & ~torch.isin(ids, self._special_ids)
        input_ids, labels = mask_tokens(ids, maskable, tokenizer.mask_token_id, self._replacement_ids, generator,
                                        rate)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}

    def _head(self, model: PreTrainedModel, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        selected = batch["labels"] != IGNORE_INDEX
        return mlm_head(model)(hidden[selected]), batch["labels"][selected]
