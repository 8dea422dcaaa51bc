"""Bad input through the real command (``fedlm.cli.main``, in process): every case ends with its exit code and
ONE line naming the culprit and the fix, never a traceback (issue 18). A case is (name, what it writes and
the command line, exit code, a piece of the one line expected)."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import transformers
import yaml

from fedlm.cli import main
from tests.conftest import make_sentences, tiny_config

Setup = Callable[[Path], list[str]]


@dataclass(frozen=True)
class Case:
    name: str
    setup: Setup
    code: int
    line: str
    patch: Callable[[pytest.MonkeyPatch], None] | None = None


def _labelled(folder: Path, labels: list[object], fmt: str = "jsonl") -> Path:
    """A JSON Lines (or CSV) file of 400 sentences with the given labels (cycled)."""
    texts = [text for text, _ in make_sentences(400)]
    path = folder / f"data.{fmt}"
    if fmt == "jsonl":
        lines = [json.dumps({"text": t, "label": labels[i % len(labels)]}) for i, t in enumerate(texts)]
    else:
        lines = ["text,label"] + [f"{t},{labels[i % len(labels)]}" for i, t in enumerate(texts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _with(lines: list[str], row: int, line: str) -> list[str]:
    return [*lines[:row], line, *lines[row + 1:]]


def _damaged(folder: Path, labels: list[object], row: int, line: str) -> Path:
    """400 rows of ``labels`` with one row replaced by ``line``."""
    path = _labelled(folder, labels)
    path.write_text("\n".join(_with(path.read_text().splitlines(), row, line)) + "\n")
    return path


def _config(folder: Path, data: dict | Path, **sections: dict) -> Path:
    """A tiny run's config (conftest's) on ``data`` (a file/folder, or a whole data section), 1 round."""
    raw = tiny_config(folder, Path("."), rounds=1)
    raw["data"] = {"source": str(data)} if isinstance(data, Path) else data
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _csv_dir(folder: Path, train: int, test: int) -> Path:
    for split, n in (("train", train), ("test", test)):
        rows = ["text,label"] + [f"{t},{lab}" for t, lab in make_sentences(n, seed=n)]
        (folder / f"{split}.csv").write_text("\n".join(rows) + "\n")
    return folder


def _partition(data: Callable[[Path], Path]) -> Setup:
    return lambda tmp: ["partition", str(_config(tmp, data(tmp)))]


def _run(data: Callable[[Path], Path], **sections: dict) -> Setup:
    return lambda tmp: ["run", str(_config(tmp, data(tmp), **sections))]


def _sentences(tmp: Path) -> Path:
    return _labelled(tmp, ["pos", "neg"], fmt="csv")


def _xml(tmp: Path) -> Path:
    (tmp / "data.xml").write_text("<a/>\n")
    return tmp / "data.xml"


def _empty_dir(tmp: Path) -> Path:
    (tmp / "empty_dir").mkdir()
    return tmp / "empty_dir"


def _a_file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("not a directory\n")
    return tmp / "a_file"


def _not_parquet(tmp: Path) -> Path:
    (tmp / "data.parquet").write_text("text,label\n")
    return tmp / "data.parquet"


def _refuse_model_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's model directory cannot be written when training is done (a full or read-only disk)."""
    def refuse(self, path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", refuse)


NAN = '{"text": "x y z", "label": NaN}'
POS_NEG = ["pos", "neg"]
CASES = [
    # config and command line
    Case("config file missing", lambda tmp: ["run", str(tmp / "nope.yaml")], 2, "config file not found"),
    Case("unknown config key", lambda tmp: ["run", str(_config(tmp, _sentences(tmp))), "train.lrr=1"], 2,
         "unknown key 'train.lrr'"),
    Case("override without =", lambda tmp: ["run", str(_config(tmp, _sentences(tmp))), "protocol.rounds"], 2,
         "is not key=value"),
    Case("report of a non-run directory", lambda tmp: ["report", str(tmp)], 2, "is not a run or grid directory"),
    # data
    Case("unknown file format", _partition(_xml), 2, "set data.format to one of"),
    Case("data.format on a named source", lambda tmp: ["partition", str(_config(
        tmp, {"source": "glue/sst2", "format": "csv"}))], 2, "data.format apply to local files only"),
    Case("JSON NaN label", _partition(lambda tmp: _damaged(tmp, [0, 1], 7, NAN)), 2, "line 8: the label is nan"),
    Case("one 0.5 among 0/1 labels", _partition(
        lambda tmp: _damaged(tmp, [0, 1], 17, '{"text": "a b", "label": 0.5}')),
         2, "1 row(s) have a stray label among classes"),
    Case("a truncated class name", _partition(
        lambda tmp: _damaged(tmp, POS_NEG, 30, '{"text": "a b", "label": "po"}')),
         2, ": 'po')"),
    Case("a NaN string label", _partition(
        lambda tmp: _damaged(tmp, POS_NEG, 31, '{"text": "a b", "label": "NaN"}')),
         2, "a missing-value marker for a label"),
    Case("task: regression on class names", lambda tmp: ["partition", str(_config(tmp, _sentences(tmp))),
                                                         "task=regression"], 2, "task: regression needs numeric"),
    Case("directory without a train file or documents", _partition(_empty_dir), 2,
         "or a directory of *.txt documents"),
    Case("labels of one class", _partition(lambda tmp: _labelled(tmp, ["pos"])), 2,
         "data.jsonl (label column 'label') has one class ('pos') in all 400 rows"),
    Case("natural partition on a column the file lacks", lambda tmp: ["partition", str(_config(
        tmp, _sentences(tmp), partition={"kind": "natural", "column": "hospital"}))], 2,
         "column 'hospital' (for group) not found in"),
    Case("a .parquet file that is not Parquet", _partition(_not_parquet), 2, "as Parquet"),
    Case("more clients than test examples", _run(lambda tmp: _csv_dir(tmp, 60, 3),
                                                 partition={"num_clients": 5}), 2, "the test split has 3 examples"),
    # model
    Case("checkpoint path that does not exist", _run(_sentences, model={"checkpoint": "./no/such/model",
                                                                        "preset": None}), 2, "does not exist"),
    Case("empty checkpoint directory", _run(_sentences, model={"checkpoint": "EMPTY", "preset": None}), 2,
         "is empty"),
    Case("unknown hub checkpoint, offline", _run(_sentences, model={"checkpoint": "nobody/no-such-model-xyz",
                                                                    "preset": None}), 2, "HF_HUB_OFFLINE is set"),
    Case("max_length beyond the positions", _run(_sentences, model={"max_length": 300}), 2,
         "exceeds the 256 positions"),
    Case("heads not dividing the width", _run(_sentences, model={"overrides": {"num_attention_heads": 3}}), 2,
         "3 attention heads do not divide the width 64"),
    Case("kv heads not dividing heads", _run(_sentences, model={"family": "llama", "overrides": {
        "num_key_value_heads": 3}}), 2, "3 key/value heads do not divide the 2 attention heads"),
    # output
    Case("output directory that cannot be written", lambda tmp: [
        "run", str(_config(tmp, _sentences(tmp), output_dir=str(_a_file(tmp) / "runs")))], 2,
         "cannot write the output directory"),
    Case("partition --out that cannot be written", lambda tmp: [
        "partition", str(_config(tmp, _sentences(tmp))), "--out", str(_a_file(tmp) / "out")], 2,
         "cannot write the partition report directory"),
    Case("model directory that cannot be written after training", _run(_sentences), 2,
         "Permission denied; fix the permissions", patch=_refuse_model_save),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_ends_with_one_line(case: Case, tmp_path: Path, capsys, monkeypatch, one_thread) -> None:
    (tmp_path / "EMPTY").mkdir()
    monkeypatch.chdir(tmp_path)
    if case.patch:
        case.patch(monkeypatch)
    argv = case.setup(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fedlm: ")]
    assert "Traceback" not in err
    assert code == case.code, err
    assert len(lines) == 1, err
    assert case.line in lines[0], lines[0]
