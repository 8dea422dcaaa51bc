"""Instruction and chat fine-tuning of a decoder-only LM: conversations rendered by a chat template, the loss on
the assistant's tokens only, evaluation by decoding the last assistant turn.

It is decoder-only seq2seq with a conversation for a source (a run resolves ``task: chat`` to the seq2seq model,
head and split path, see ``run.prepare``): only the rows differ. Each conversation is rendered in segments: for
the assistant turn ``i``, the template's text for turns ``< i`` with the generation prompt is the prompt, and
what rendering turn ``i`` adds after it is that turn's segment (its content and the template's end of the turn:
``eos`` for the named templates, e.g. ``<|im_end|>\\n`` for ChatML ones). Segments are tokenized one by one, so
the token ids of a prompt are exactly those that evaluation decodes from, and the labels are the assistant
segments' ids (``IGNORE_INDEX`` everywhere else).

Templates: the tokenizer's own ``chat_template`` when it has one (``data.chat_template: auto``), or a named one
(:data:`TEMPLATES`; a tokenizer fedlm trains has none, so ``auto`` falls back to ``plain``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import datasets
import torch
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from fedlm.data.sources.chat import Message, check_messages, conversation
from fedlm.errors import UserError
from fedlm.tasks.base import IGNORE_INDEX, Batch, map_batches, pad_ids
from fedlm.tasks.generation import left_pad, texts_to_bytes
from fedlm.tasks.seq2seq import Seq2SeqTask


def _headed(system: str, user: str, assistant: str) -> str:
    """A template of ``### <header>:`` blocks separated by blank lines; an assistant turn ends with eos (so that
    decoding stops there) and nothing follows it, so its segment is its content plus eos exactly. (Separators are
    Jinja expressions: transformers renders with ``trim_blocks``, which eats a newline written after a tag.)"""
    headers = {"system": system, "user": user, "assistant": assistant}
    turn = "".join(f"{{% {'if' if i == 0 else 'elif'} m.role == '{role}' %}}### {header}:{{{{ '\\n' }}}}"
                   for i, (role, header) in enumerate(headers.items()))
    return (
        "{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
        + turn + "{% endif %}{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
        + "{% if add_generation_prompt %}{% if messages %}{{ '\\n\\n' }}{% endif %}"
        + f"### {assistant}:{{{{ '\\n' }}}}{{% endif %}}"
    )


TEMPLATES = {
    "plain": _headed("System", "User", "Assistant"),
    "alpaca": _headed("System", "Instruction", "Response"),
}
CHOICES = ("auto", "tokenizer", *TEMPLATES)  # data.chat_template


def template_of(tokenizer: PreTrainedTokenizerBase, choice: str) -> str:
    """The Jinja template ``choice`` names for ``tokenizer`` (auto: its own, else plain)."""
    own = getattr(tokenizer, "chat_template", None)
    if choice in ("auto", "tokenizer") and isinstance(own, str) and own:
        return own
    if choice == "tokenizer":
        raise UserError(f"data.chat_template: tokenizer, but this tokenizer has no chat template; choose one of "
                        f"{', '.join(TEMPLATES)} (or auto)")
    if choice == "auto":
        return TEMPLATES["plain"]
    if choice not in TEMPLATES:
        raise UserError(f"unknown chat template {choice!r}; choose one of {', '.join(CHOICES)}")
    return TEMPLATES[choice]


def segments(tokenizer: PreTrainedTokenizerBase, template: str, turns: list[Message]) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is an assistant segment) pieces whose concatenation is the whole
    rendering; a template that cannot render it, or that renders a prefix of the conversation other than as a
    prefix of the whole, is one line (its assistant turns could not be told apart)."""

    def render(upto: int, prompt: bool) -> str:
        try:
            text = tokenizer.apply_chat_template(turns[:upto], chat_template=template, tokenize=False,
                                                 add_generation_prompt=prompt)
        except (TemplateError, TypeError, ValueError) as e:
            raise UserError(f"the chat template does not render a conversation ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'no message'})") from None
        if not isinstance(text, str):
            raise UserError(f"the chat template renders {type(text).__name__}, not text")
        return text

    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        prompt, full = render(i, True), render(i + 1, False)
        if not prompt.startswith(done) or not full.startswith(prompt) or full == prompt:
            raise UserError(f"the chat template does not render turn {i + 1} (assistant) as a continuation of the "
                            "turns before it, so the assistant's tokens cannot be told apart; use a named "
                            f"template (data.chat_template: {' | '.join(TEMPLATES)})")
        pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    whole = render(len(turns), False)
    if not whole.startswith(done):
        raise UserError("the chat template renders the whole conversation other than its turns one by one")
    return [*pieces, (whole[len(done):], False)]


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase, template: str) -> tuple[int, ...]:
    """The special token the template ends an assistant turn with, where it is not eos (ChatML's ``<|im_end|>``,
    Gemma's ``<end_of_turn>``): decoding stops there too, as the model was taught to end its answers with it.
    Empty when the turn ends in eos or in plain text."""
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    try:
        turn = next(text for text, assistant in segments(tokenizer, template, probe) if assistant)
    except UserError:
        return ()  # a template that needs more than the probe: the conversations themselves will say so
    ending = turn[turn.index("a") + 1:] if "a" in turn else ""
    ids = tokenizer(ending, add_special_tokens=False)["input_ids"] if ending else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return (ids[0],) if ids and ids[0] in special and ids[0] != tokenizer.eos_token_id else ()


class ChatTask(Seq2SeqTask):
    """Conversations (system / user / assistant turns) for a decoder-only LM; the loss on assistant tokens."""

    name = "chat"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None = None,
        template: str = "auto",
        num_beams: int = 1,
        max_new_tokens: int = 64,
        *,
        metrics: Sequence[str] | None = None,
        precision: str = "fp32",
    ) -> None:
        super().__init__(tokenizer, encoder_decoder=False, num_beams=num_beams, max_new_tokens=max_new_tokens,
                         metrics=metrics, precision=precision)
        self.template = template

    def preprocess(self, ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
        """Conversations (the loader's ``target`` column, see ``data.sources.chat``) -> ``input_ids`` (cut to
        ``max_length``), ``labels``, the last assistant turn's prompt (its last ``max_length - max_new_tokens``
        tokens, so that a generation fits) and content (the ROUGE reference)."""
        self.bind(tokenizer)
        if self.target_column not in ds.column_names:
            raise UserError("chat data needs conversations: load it with task: chat (a messages column, "
                            "instruction / output columns, or prompt / response columns)")
        template = template_of(tokenizer, self.template)
        self.stop_ids = end_of_turn_ids(tokenizer, template)
        return map_batches(ds, self._rows(template, max_length))

    def _rows(self, template: str, max_length: int) -> Callable[[dict[str, list]], dict[str, list]]:
        tokenizer = self.bound_tokenizer
        budget = max_length - self.decoding.max_new_tokens
        if budget < 1:
            raise UserError(f"model.max_length = {max_length} leaves no room for a prompt before "
                            f"generation.max_new_tokens ({self.decoding.max_new_tokens}); raise model.max_length "
                            "or lower generation.max_new_tokens")

        def encode(batch: dict[str, list]) -> dict[str, list]:
            out: dict[str, list] = {"input_ids": [], "labels": [], "prompt_ids": [], "reference": []}
            for target in batch[self.target_column]:
                turns = check_messages("chat data", "conversation", conversation(target))
                row = encode_conversation(tokenizer, template, turns)
                last = max(j for j, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
                start = next(j for j in range(last, -1, -1) if row["labels"][j] == IGNORE_INDEX) + 1
                out["input_ids"].append(row["input_ids"][:max_length])
                out["labels"].append(row["labels"][:max_length])
                out["prompt_ids"].append(row["input_ids"][:start][-budget:])
                out["reference"].append(next(t["content"] for t in reversed(turns) if t["role"] == "assistant"))
            return out

        return encode

    def collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """input_ids, attention_mask and the rows' labels (IGNORE_INDEX on padding too)."""
        ids, mask = pad_ids([row["input_ids"] for row in rows], self.bound_tokenizer.pad_token_id)
        labels = pad_ids([row["labels"] for row in rows], IGNORE_INDEX)[0]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def eval_collate(self, rows: list[dict], generator: torch.Generator) -> Batch:
        """``collate`` plus the references and the left-padded prompts of the last assistant turns."""
        batch = self.collate(rows, generator)
        batch["references"] = texts_to_bytes([row["reference"] for row in rows])
        batch["prompt_ids"], batch["prompt_mask"] = left_pad([row["prompt_ids"] for row in rows],
                                                             self.bound_tokenizer.pad_token_id)
        return batch


def encode_conversation(tokenizer: PreTrainedTokenizerBase, template: str,
                        turns: list[Message]) -> dict[str, list[int]]:
    """One conversation's ``input_ids`` and ``labels`` (the ids on assistant segments, IGNORE_INDEX elsewhere);
    special tokens are the template's to write, so none is added."""
    pieces = segments(tokenizer, template, turns)
    ids: list[int] = []
    labels: list[int] = []
    for (_, assistant), piece in zip(pieces, tokenizer([text for text, _ in pieces], add_special_tokens=False,
                                                       verbose=False)["input_ids"], strict=True):
        ids += piece
        labels += piece if assistant else [IGNORE_INDEX] * len(piece)
    return {"input_ids": ids, "labels": labels}
