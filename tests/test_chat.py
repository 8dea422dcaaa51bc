"""Chat / instruction data: the three row shapes, the loss on exactly the assistant's tokens (named template and a
tokenizer's own chat template), bad input in one line, and FedAvg and split runs with decoding at evaluation."""

from __future__ import annotations

import copy
import json
import random
import typing
from pathlib import Path

import datasets
import pytest
import torch

from fedlm.cli import main
from fedlm.config import validate
from fedlm.config.sections import DataConfig
from fedlm.data.sources import load_source
from fedlm.errors import UserError
from fedlm.models.build import build_tokenizer
from fedlm.run.prepare import build_task, resolve_task
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from fedlm.tasks import ChatTask, get_task
from fedlm.tasks.base import IGNORE_INDEX
from fedlm.tasks.chat import CHOICES, TEMPLATES, encode_conversation, end_of_turn_ids, template_of

pytestmark = pytest.mark.usefixtures("one_thread")

ITEMS = ["tea", "coffee", "milk", "water", "juice", "soup", "bread", "rice"]
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "and how are you"},
    {"role": "assistant", "content": "I am fine"},
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chats(n: int, seed: int = 0) -> list[dict]:
    """A toy instruction task: the assistant repeats what the user asks for."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        wanted, other = rng.sample(ITEMS, 2)
        rows.append({"messages": [{"role": "user", "content": f"I would like {wanted}, not {other}."},
                                  {"role": "assistant", "content": f"Here is your {wanted}."}]})
    return rows


CHATS = make_chats(40)
TEXTS = [turn["content"] for row in CHATS for turn in row["messages"]] + [t["content"] for t in CONVERSATION]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {family: build_tokenizer(None, family, TEXTS, 300) for family in ("llama", "gpt2")}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _runs(positions: list[int]) -> list[list[int]]:
    """Consecutive runs of positions."""
    out: list[list[int]] = []
    for p in positions:
        if out and p == out[-1][-1] + 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


# --------------------------------------------------------------------------------------------- the loss mask


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_only_the_assistant_content_and_eos_are_labelled(tokenizers, family):
    tokenizer = tokenizers[family]
    row = encode_conversation(tokenizer, TEMPLATES["plain"], CONVERSATION)
    ids, labels = row["input_ids"], row["labels"]
    assert len(ids) == len(labels)
    labelled = [j for j, label in enumerate(labels) if label != IGNORE_INDEX]
    eos = tokenizer.eos_token_id
    # exactly two runs: "four" + eos and "I am fine" + eos, each labelled with its own ids
    first, second = [*_ids(tokenizer, "four"), eos], [*_ids(tokenizer, "I am fine"), eos]
    assert [len(run) for run in _runs(labelled)] == [len(first), len(second)]
    assert [ids[j] for j in labelled] == first + second == [labels[j] for j in labelled]
    assert labelled[-1] == len(ids) - 1  # nothing after the last assistant turn
    # the unlabelled tokens are the whole rendering but the assistant turns' content and eos
    prompt_text = tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label == IGNORE_INDEX])
    assert prompt_text == ("### System:\nAnswer briefly.\n\n### User:\nwhat is two plus two\n\n### Assistant:\n"
                           "\n\n### User:\nand how are you\n\n### Assistant:\n")
    # the loss counts those tokens and no others (position t predicts label t + 1)
    task = get_task("chat", tokenizer, max_new_tokens=8)
    batch = task.collate([row, {"input_ids": ids[:5], "labels": [IGNORE_INDEX] * 5}], torch.Generator())
    predicted = batch["labels"][:, 1:][batch["labels"][:, 1:] != IGNORE_INDEX]
    assert predicted.tolist() == first + second


def test_a_tokenizer_chat_template_labels_content_and_its_end_of_turn(tokenizers):
    tokenizer = tokenizers["llama"]
    tokenizer.chat_template = CHATML
    try:
        template = template_of(tokenizer, "auto")
        assert template == CHATML
        row = encode_conversation(tokenizer, template, CONVERSATION)
    finally:
        tokenizer.chat_template = None
    labelled = [row["input_ids"][j] for j, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
    assert labelled == _ids(tokenizer, "four<|im_end|>\n") + _ids(tokenizer, "I am fine<|im_end|>\n")
    unlabelled = [i for i, label in zip(row["input_ids"], row["labels"], strict=True) if label == IGNORE_INDEX]
    assert tokenizer.decode(unlabelled) == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nwhat is two plus two<|im_end|>\n"
        "<|im_start|>assistant\n<|im_start|>user\nand how are you<|im_end|>\n<|im_start|>assistant\n")


def test_decoding_stops_at_a_templates_end_of_turn_token(tokenizers):
    tokenizer = copy.deepcopy(tokenizers["llama"])
    assert end_of_turn_ids(tokenizer, CHATML) == ()  # <|im_end|> is plain text to this tokenizer
    assert end_of_turn_ids(tokenizer, TEMPLATES["plain"]) == ()  # the named templates end turns with eos
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_ids(tokenizer, CHATML) == (end,)
    task = ChatTask(template="tokenizer", max_new_tokens=4)
    tokenizer.chat_template = CHATML
    task.preprocess(datasets.Dataset.from_dict({"target": [json.dumps(CONVERSATION)]}), tokenizer, 64)
    assert task.stop_ids == (end,)


def test_template_choice(tokenizers):
    tokenizer = tokenizers["llama"]
    assert template_of(tokenizer, "auto") == TEMPLATES["plain"]  # fedlm's tokenizers have no chat template
    assert template_of(tokenizer, "alpaca") == TEMPLATES["alpaca"]
    with pytest.raises(UserError, match="has no chat template"):
        template_of(tokenizer, "tokenizer")
    assert set(typing.get_args(DataConfig.model_fields["chat_template"].annotation)) == set(CHOICES)


def test_preprocess_keeps_the_last_turn_as_prompt_and_reference(tokenizers):
    tokenizer = tokenizers["llama"]
    task = get_task("chat", max_new_tokens=4)
    ds = datasets.Dataset.from_dict({"text": ["x"], "target": [json.dumps(CONVERSATION)]})
    full = encode_conversation(tokenizer, TEMPLATES["plain"], CONVERSATION)
    start = len(full["labels"]) - len(_ids(tokenizer, "I am fine")) - 1  # where the last assistant turn starts
    for max_length in (len(full["input_ids"]) + 10, 20):  # whole, and cut (the prompt to what leaves 4 tokens)
        (row,) = task.preprocess(ds, tokenizer, max_length).to_list()
        assert row["reference"] == "I am fine"
        assert row["input_ids"] == full["input_ids"][:max_length] and row["labels"] == full["labels"][:max_length]
        assert row["prompt_ids"] == full["input_ids"][:start][-(max_length - 4):]
        batch = task.eval_collate([row], torch.Generator())
        assert batch["prompt_ids"][0].tolist() == row["prompt_ids"]
    assert len(row["prompt_ids"]) == 16


# --------------------------------------------------------------------------------------------- loading


def test_messages_alpaca_and_prompt_response_rows_load_as_conversations(tmp_path):
    messages = load_source(str(_write_jsonl(tmp_path / "m.jsonl", CHATS)), tmp_path, task="chat")
    assert messages.kind == "chat" and len(messages.splits["train"]) + len(messages.splits["test"]) == 40
    first = json.loads(messages.splits["train"]["target"][0])
    assert [turn["role"] for turn in first] == ["user", "assistant"]
    alpaca = _write_jsonl(tmp_path / "a.jsonl", [
        {"instruction": "Translate", "input": "hallo", "output": "hello"},
        {"instruction": "Say hi", "input": "", "output": "hi"}] * 3)
    rows = [json.loads(t) for t in load_source(str(alpaca), tmp_path, task="chat").splits["train"]["target"]]
    assert {"role": "user", "content": "Translate\n\nhallo"} in [row[0] for row in rows]
    assert {"role": "user", "content": "Say hi"} in [row[0] for row in rows]
    turns = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    sharegpt = _write_jsonl(tmp_path / "s.jsonl", [{"conversations": turns}] * 4)
    rows = [json.loads(t) for t in load_source(str(sharegpt), tmp_path, task="chat").splits["train"]["target"]]
    assert rows[0] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "yo"}]
    csv = tmp_path / "p.csv"
    csv.write_text("q,a,site\n" + "".join(f"ask {i},reply {i},s{i % 2}\n" for i in range(6)))
    pairs = load_source(str(csv), tmp_path, task="chat", columns={"text": "q", "target": "a", "group": "site"})
    train = pairs.splits["train"]
    assert json.loads(train["target"][0])[1]["content"].startswith("reply") and set(train["group"]) <= {"s0", "s1"}


@pytest.mark.parametrize(("rows", "expected"), [
    ([{"messages": [{"role": "user", "content": "hi"}]}], "line 1: the conversation has no assistant turn"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}],
     "line 1: message 2 has the unknown role 'bot'"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}],
     "message 2 \\(assistant\\) has content of type NoneType"),
    ([{"question_text": "hi", "reply": "yo"}], "has no chat columns"),
    ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}],
     "line 1: turn 2 is from the unknown speaker 'bot'"),
    ([{"conversations": [{"from": "human", "value": "hi"}]}], "line 1: the conversation has no assistant turn"),
])
def test_bad_rows_are_one_line(tmp_path, rows, expected):
    source = _write_jsonl(tmp_path / "bad.jsonl", rows * 4)
    with pytest.raises(UserError, match=expected) as error:
        load_source(str(source), tmp_path, task="chat")
    assert "\n" not in str(error.value) and "bad.jsonl" in str(error.value)


def test_missing_mapped_column_and_unknown_role_are_one_line(tmp_path):
    source = _write_jsonl(tmp_path / "d.jsonl", CHATS)
    with pytest.raises(UserError, match="column 'conv' not found"):
        load_source(str(source), tmp_path, task="chat", columns={"messages": "conv"})
    with pytest.raises(UserError, match="unknown column role 'label' for chat data"):
        load_source(str(source), tmp_path, task="chat", columns={"label": "messages"})


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}{{ m.content }}", "does not render a conversation \\(TemplateSyntaxError"),
    ("{{ raise_exception('system turns are not supported') }}", "system turns are not supported"),
    ("{{ messages | length }}", "does not render turn 3"),
])
def test_a_template_that_does_not_render_is_one_line(tokenizers, template, expected):
    with pytest.raises(UserError, match=expected) as error:
        encode_conversation(tokenizers["gpt2"], template, CONVERSATION)
    assert "\n" not in str(error.value)


def test_task_chat_needs_chat_data_and_a_decoder(tmp_path):
    with pytest.raises(UserError, match="task = 'chat' needs conversations"):
        resolve_task("chat", "seq2seq", "llama")
    assert resolve_task("chat", "chat", "llama") == "seq2seq"  # the model, head and split path of seq2seq
    with pytest.raises(UserError, match=r"data\.chat_template is for task chat"):
        validate({"name": "x", "task": "seq2seq", "data": {"source": "x.jsonl", "chat_template": "plain"}})
    t5 = validate({"name": "x", "task": "chat", "data": {"source": "x.jsonl"}, "model": {"family": "t5"}})
    with pytest.raises(UserError, match="t5 is an encoder-decoder"):
        build_task(t5, "seq2seq", encoder_decoder=True)


# --------------------------------------------------------------------------------------------- runs


def _config(tmp_path: Path, source: Path, **extra) -> dict:
    return {
        "name": "chat", "seed": 3, "output_dir": str(tmp_path / "runs"), "task": "chat",
        "data": {"source": str(source), "test_fraction": 0.25},
        "partition": {"kind": "iid", "num_clients": 2},
        "model": {"family": "llama", "preset": "tiny", "vocab_size": 300, "max_length": 48},
        "train": {"lr": 0.003, "batch_size": 8, "group_by_length": True},
        "protocol": {"kind": "fedavg", "rounds": 2},
        "generation": {"max_new_tokens": 8},
        "eval": {"batch_size": 16},
        **extra,
    }


def test_chat_runs_under_fedavg_and_decodes_at_evaluation(tmp_path):
    source = _write_jsonl(tmp_path / "d.jsonl", CHATS)
    raw = _config(tmp_path, source)
    raw["eval"]["metrics"] = ["loss", "exact_match", "f1"]
    run_single(validate(raw), tmp_path, tmp_path / "fedavg")
    records = read_metrics(tmp_path / "fedavg")
    assert [r["round"] for r in records] == [0, 1, 2]
    assert records[-1]["test_loss"] < records[0]["test_loss"] and 0.0 <= records[-1]["test_rougeL"] <= 1.0
    assert 0.0 <= records[-1]["test_exact_match"] <= records[-1]["test_f1"] <= 1.0
    assert "test_rouge1" not in records[-1]  # what eval.metrics leaves out is not reported


def test_chat_runs_by_split_learning(tmp_path):
    source = _write_jsonl(tmp_path / "d.jsonl", CHATS)
    raw = _config(tmp_path, source, split={"bottom_blocks": 0, "top_blocks": 0})
    raw["protocol"]["rounds"] = 1
    raw["train"]["group_by_length"] = False
    run_single(validate(raw), tmp_path, tmp_path / "split")
    last = read_metrics(tmp_path / "split")[-1]
    assert last["bytes_up_boundary"] > 0 and 0.0 <= last["test_rougeL"] <= 1.0


def test_bad_chat_data_exits_2_in_one_line(tmp_path, capsys):
    source = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    config = tmp_path / "bad.yaml"
    config.write_text(json.dumps(_config(tmp_path, source)))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no assistant turn" in err and "bad.jsonl" in err and len(err.splitlines()) == 1


def test_chat_is_a_registered_seq2seq_task():
    assert isinstance(get_task("chat"), ChatTask) and ChatTask.row_wise


def test_rows_without_conversations_are_refused_in_one_line(tokenizers):
    ds = datasets.Dataset.from_dict({"text": ["a source"], "target": ["a plain target"]})
    with pytest.raises(UserError, match="load the data with task: chat"):
        get_task("chat", max_new_tokens=8).preprocess(ds, tokenizers["gpt2"], 64)
