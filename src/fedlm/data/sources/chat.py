"""Instruction and chat data (``task: chat``): local JSONL / JSON / Parquet / CSV / TSV files whose rows are

* a conversation: a ``messages`` column of ``{"role": "system" | "user" | "assistant", "content": ...}`` turns,
  or ShareGPT's ``conversations`` column of ``{"from": "system" | "human" | "gpt", "value": ...}`` turns;
* an Alpaca-style instruction: ``instruction``, optional ``input`` and ``output`` columns;
* any prompt / response pair: ``prompt`` / ``response`` columns (or ``question`` / ``answer``), or the columns
  that ``data.columns {text: <prompt>, target: <response>}`` maps.

Every row becomes one conversation, checked here (where the file and line are known) so that tokenizing never
meets a bad one. A dataset holds text columns only and its extra columns are partition factors, so the
conversation rides in the ``target`` column as JSON (:func:`conversation`); ``text`` holds its turns' plain
text (partition statistics read it; a tokenizer fedlm trains reads both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedlm.data.sources import builders, readers
from fedlm.data.sources.columns import (
    Columns,
    RawSource,
    field_of,
    given_or_split,
    group_value,
    split_files,
    text_of,
)
from fedlm.errors import UserError

KIND = "chat"
ROLES = ("system", "user", "assistant")
MAPPABLE = ("messages", "text", "target", "group")  # data.columns roles of chat data (text: prompt, target: response)
_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv"}
_PROMPTS = ("prompt", "question", "query")
_RESPONSES = ("response", "answer", "completion", "chosen")
Message = dict[str, str]
SHAREGPT = "conversations"  # ShareGPT's column of {from, value} turns
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def conversation(target: str) -> list[Message]:
    """The conversation a loaded row's ``target`` column holds."""
    try:
        return json.loads(target)
    except json.JSONDecodeError:
        raise UserError("chat rows hold conversations, and this one holds plain text: load the data with "
                        "task: chat") from None


def check_messages(what: object, where: str, value: Any) -> list[Message]:
    """A ``messages`` value as role / content turns; one line for each way it can be wrong."""
    if not isinstance(value, list) or not value:
        raise UserError(f"{what} {where}: 'messages' should be a non-empty list of {{role, content}} turns")
    turns: list[Message] = []
    for i, turn in enumerate(value, 1):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise UserError(f"{what} {where}: message {i} should be an object with 'role' and 'content'")
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            raise UserError(f"{what} {where}: message {i} has the unknown role {role!r}; roles are "
                            f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise UserError(f"{what} {where}: message {i} ({role}) has content of type {type(content).__name__}; "
                            "it should be text")
        turns.append({"role": role, "content": content})
    if not any(turn["role"] == "assistant" and turn["content"].strip() for turn in turns):
        raise UserError(f"{what} {where}: the conversation has no assistant turn (with text); the loss is on the "
                        "assistant's tokens only, so it would teach nothing")
    return turns


def from_sharegpt(what: object, where: str, value: Any) -> Any:
    """ShareGPT's ``{from, value}`` turns as ``{role, content}`` ones (``human`` is the user, ``gpt`` the
    assistant); anything else is left for :func:`check_messages` to name."""
    if not isinstance(value, list):
        return value
    turns = []
    for i, turn in enumerate(value, 1):
        if isinstance(turn, dict) and "from" in turn and "value" in turn:
            speaker = turn["from"]
            if speaker not in SHAREGPT_ROLES:
                raise UserError(f"{what} {where}: turn {i} is from the unknown speaker {speaker!r}; ShareGPT "
                                f"speakers are {', '.join(SHAREGPT_ROLES)}")
            turn = {"role": SHAREGPT_ROLES[speaker], "content": turn["value"]}
        turns.append(turn)
    return turns


def _layout(columns: dict[str, str] | None, available: list[str], what: object) -> tuple[str, dict[str, str]]:
    """Which of the three row shapes the file has, and role -> column for it."""
    mapping = dict(columns or {})
    if bad := [role for role in mapping if role not in MAPPABLE]:
        raise UserError(f"unknown column role '{bad[0]}' for chat data; use {', '.join(MAPPABLE)}")
    if missing := [column for column in mapping.values() if column not in available]:
        raise UserError(f"column '{missing[0]}' not found in {what}; columns are: {', '.join(available)}")
    pair = {"text", "target"} & set(mapping)
    if "messages" not in mapping and not pair and "messages" not in available and SHAREGPT in available:
        return "sharegpt", {"messages": SHAREGPT, **mapping}
    if "messages" in mapping or (not pair and "messages" in available):
        if pair:
            raise UserError(f"{what}: map messages or text / target (prompt / response) for chat data, not both")
        return "messages", {"messages": "messages", **mapping}
    if not pair and {"instruction", "output"} <= set(available):
        extra = {"input": "input"} if "input" in available else {}
        return "alpaca", {"instruction": "instruction", "output": "output", **extra, **mapping}
    for role, names in (("text", _PROMPTS), ("target", _RESPONSES)):
        if role not in mapping and (hit := next((n for n in names if n in available), None)):
            mapping[role] = hit
    if {"text", "target"} - set(mapping):
        raise UserError(f"{what} has no chat columns (columns are: {', '.join(available)}): give a 'messages' "
                        "column, instruction / output columns, or prompt / response columns (map them with "
                        "data.columns {text: <prompt column>, target: <response column>})")
    return "pair", mapping


def _turns(path: Path, where: str, fields: dict[str, Any], shape: str, mapping: dict[str, str]) -> list[Message]:
    if shape == "messages":
        return check_messages(path, where, field_of(path, where, fields, mapping["messages"]))
    if shape == "sharegpt":
        return check_messages(path, where, from_sharegpt(path, where, field_of(path, where, fields, SHAREGPT)))
    if shape == "alpaca":
        prompt = text_of(path, where, fields, mapping["instruction"])
        extra = fields.get(mapping["input"]) if "input" in mapping else None
        if isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        response = text_of(path, where, fields, mapping["output"])
    else:
        prompt = text_of(path, where, fields, mapping["text"])
        response = text_of(path, where, fields, mapping["target"])
    return check_messages(path, where, [{"role": "user", "content": prompt},
                                        {"role": "assistant", "content": response}])


def _read_split(path: Path, fmt: str, columns: dict[str, str] | None) -> Columns:
    def rows(tabulate: builders.Tabulate) -> Columns:
        available, records = tabulate(True)
        shape, mapping = _layout(columns, available, path)
        cols: Columns = {"text": [], "target": [], **({"group": []} if "group" in mapping else {})}
        for where, fields in records:
            turns = _turns(path, where, fields, shape, mapping)
            cols["text"].append("\n".join(turn["content"] for turn in turns))
            cols["target"].append(json.dumps(turns, ensure_ascii=False))
            if "group" in mapping:
                cols["group"].append(group_value(path, where, mapping["group"], fields.get(mapping["group"])))
        return cols

    cols = rows(lambda header: readers.read_parquet(path)) if fmt == "parquet" else builders.read_table(path, fmt, rows)
    if not cols["text"]:
        raise UserError(f"no conversations in {path}")
    return cols


def _format(path: Path, file_format: str | None) -> str:
    fmt = (file_format or _SUFFIXES.get(path.suffix.lower(), "")).lower().lstrip(".")
    if fmt not in _SUFFIXES.values():
        raise UserError(f"chat data is read from {', '.join(_SUFFIXES.values())} files; cannot read {path} "
                        "(set data.format if its suffix misleads)")
    return fmt


def load_chat(path: Path, columns: dict[str, str] | None, file_format: str | None, fraction: float,
              seed: int) -> RawSource:
    """A chat file, or a directory of split files (train.jsonl beside test.jsonl ...), as conversations."""
    files = (split_files(path, _SUFFIXES, "expected train.jsonl/.json/.parquet/.csv/.tsv for task chat")
             if path.is_dir() else {"train": path})
    splits = {split: _read_split(p, _format(p, file_format), columns) for split, p in files.items()}
    return RawSource(splits, KIND, None, given_or_split(splits, files, fraction, seed), list(files.values()))
