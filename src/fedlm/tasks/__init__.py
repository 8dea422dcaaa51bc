"""Training tasks (masked LM, causal LM, classification, regression, seq2seq, chat) and their registry: each is a
`Task` that tokenizes, collates, computes its loss (from the model or from hidden states) and evaluates."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from fedlm.errors import UserError
from fedlm.tasks.base import Task
from fedlm.tasks.chat import ChatTask
from fedlm.tasks.choice import MultipleChoiceTask
from fedlm.tasks.classification import ClassificationTask, RegressionTask
from fedlm.tasks.clm import CausalLMTask
from fedlm.tasks.mlm import MaskedLMTask
from fedlm.tasks.qa import QATask
from fedlm.tasks.seq2seq import Seq2SeqTask
from fedlm.tasks.tagging import TaggingTask

TASKS: dict[str, type[Task]] = {
    task.name: task for task in (MaskedLMTask, CausalLMTask, ClassificationTask, RegressionTask, Seq2SeqTask,
                                  TaggingTask, QATask, MultipleChoiceTask, ChatTask)
}


def get_task(name: str, tokenizer: PreTrainedTokenizerBase | None = None, **options) -> Task:
    """A fresh task instance; ``options`` go to its constructor (e.g. ``target="mcc"``, ``precision="bf16"``)."""
    if name not in TASKS:
        raise UserError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name](tokenizer, **options)


__all__ = [
    "TASKS",
    "CausalLMTask",
    "ChatTask",
    "ClassificationTask",
    "MaskedLMTask",
    "MultipleChoiceTask",
    "QATask",
    "RegressionTask",
    "Seq2SeqTask",
    "TaggingTask",
    "Task",
    "get_task",
]
