"""Token classification: label alignment, seqeval scores, CoNLL / JSONL readers, training, FedAvg, split."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from fedlm import metrics
from fedlm.config import validate
from fedlm.data.inputs import partition_input
from fedlm.data.sources import load_source
from fedlm.data.sources.conll import sentence_entity_labels
from fedlm.errors import UserError
from fedlm.models.build import FAMILIES, build_tokenizer
from fedlm.models.cut import Cut
from fedlm.run.prepare import resolve_task
from fedlm.run.recorder import read_metrics
from fedlm.tasks import get_task
from fedlm.tasks.base import IGNORE_INDEX
from fedlm.tasks.tagging import align_labels, word_spans
from tests.conftest import SHARED_DATA
from tests.split_helpers import assert_split_step_equals_unsplit
from tests.tiny_models import tiny_model
from tests.training_helpers import central_steps, cli_run, one_client_fedavg_equals_centralized

pytestmark = pytest.mark.usefixtures("one_thread")

TAGS = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
OUT, B_LOC, I_LOC, B_PER, I_PER = range(5)
SENTENCES = [
    (["John", "Smith", "visited", "Paris", "."], [B_PER, I_PER, OUT, B_LOC, OUT]),
    (["Mary", "lives", "in", "New", "York", "."], [B_PER, OUT, OUT, B_LOC, I_LOC, OUT]),
    (["Paris", "and", "Rome", "are", "far", "."], [B_LOC, OUT, B_LOC, OUT, OUT, OUT]),
    (["we", "met", "John", "in", "Rome"], [OUT, OUT, B_PER, OUT, B_LOC]),
] * 3


def _wordpiece() -> PreTrainedTokenizerFast:
    """A hand-made WordPiece vocabulary: 'washington' is exactly wash + ##ing + ##ton."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "john", "visited", "wash", "##ing", "##ton", "met"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                 ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


def _dataset(sentences=SENTENCES) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"tokens": [w for w, _ in sentences], "tags": [t for _, t in sentences]})


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    texts = [" ".join(words) for words, _ in SENTENCES]
    return {family: build_tokenizer(None, family, texts, 150) for family in FAMILIES}


def _model(family, tokenizers, layers=2, seed=0):
    return tiny_model(family, "tagging", tokenizers[family], layers, seed, num_labels=len(TAGS))


# ----------------------------------------------------------------------------------------------- alignment


def test_first_subword_carries_the_tag_and_continuations_are_ignored():
    tok = _wordpiece()
    words = ["John", "Washington", "visited", "Washington"]
    tags = [B_PER, I_PER, OUT, B_LOC]  # the B-LOC sits on a word of three sub-words, after an I- word
    rows = get_task("tagging", label_names=TAGS).preprocess(_dataset([(words, tags)]), tok, 32).to_list()
    pieces = tok.convert_ids_to_tokens(rows[0]["input_ids"])
    assert pieces == ["[CLS]", "john", "wash", "##ing", "##ton", "visited", "wash", "##ing", "##ton", "[SEP]"]
    ignored = IGNORE_INDEX
    assert rows[0]["labels"] == [ignored, B_PER, I_PER, ignored, ignored, OUT, B_LOC, ignored, ignored, ignored]
    assert rows[0]["label_words"] == [-1, 0, 1, -1, -1, 2, 3, -1, -1, -1]
    assert rows[0]["word_tags"] == tags


def test_byte_level_space_tokens_belong_to_no_word():
    text, spans = word_spans(["John", "Smith"])
    assert text == "John Smith" and spans == [(0, 4), (5, 10)]
    # byte-level BPE: "John", a bare space token, then " Smi" (with its space) and "th"; specials are (0, 0)
    offsets = [(0, 0), (0, 4), (4, 5), (4, 8), (8, 10), (0, 0)]
    labels, words = align_labels(offsets, spans, [B_PER, I_PER])
    assert labels == [IGNORE_INDEX, B_PER, IGNORE_INDEX, I_PER, IGNORE_INDEX, IGNORE_INDEX]
    assert words == [-1, 0, -1, 1, -1, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_word_gets_exactly_one_label_in_every_family(tokenizers, family):
    rows = get_task("tagging", label_names=TAGS).preprocess(_dataset(), tokenizers[family], 128).to_list()
    for row, (_, tags) in zip(rows, SENTENCES, strict=True):
        assert [label for label in row["labels"] if label != IGNORE_INDEX] == tags
        assert [word for word in row["label_words"] if word >= 0] == list(range(len(tags)))


# ------------------------------------------------------------------------------------------------- metrics


def test_seqeval_strict_scores_match_hand_computed_values():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["I-ORG", "O"]]  # strict IOB2: a lone I-ORG is no entity
    scores = metrics.entity_scores(gold, pred)
    # gold entities PER, LOC, ORG; predicted PER, ORG(wrong span type); one correct
    assert scores["precision"] == pytest.approx(1 / 2)
    assert scores["recall"] == pytest.approx(1 / 3)
    assert scores["f1"] == pytest.approx(2 * (1 / 2) * (1 / 3) / (1 / 2 + 1 / 3))
    assert scores["accuracy"] == pytest.approx(4 / 6)


def test_truncated_words_are_scored_as_predicted_o(tokenizers):
    task = get_task("tagging", label_names=TAGS)
    rows = task.preprocess(_dataset(), tokenizers["bert"], 5).to_list()  # keeps three tokens of each
    assert any(sum(w >= 0 for w in row["label_words"]) < len(row["word_tags"]) for row in rows)
    model = _model("bert", tokenizers).eval()
    part = task._eval_batch(model, task.eval_collate(rows, torch.Generator()))
    assert [len(tags) for tags in part["gold"]] == [len(tags) for _, tags in SENTENCES]
    for row, guess in zip(rows, part["pred"], strict=True):
        kept = sum(w >= 0 for w in row["label_words"])
        assert guess[kept:] == ["O"] * (len(guess) - kept)


def test_sentence_label_is_the_majority_entity_type():
    names = ["O", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-PER", "I-PER"]
    tags = [
        [0, 5, 6, 0, 1, 0, 1],  # one PER, two LOC -> LOC
        [3, 4, 4, 4, 0, 5],  # one long ORG, one PER: entities are counted, a tie goes to ORG (alphabetical)
        [0, 0],  # no entity
        [2, 2, 0, 6],  # I- without B- starts an entity: LOC, PER tie -> LOC
    ]
    labels, classes = sentence_entity_labels(tags, names)
    assert classes == ["O (no entity)", "LOC", "ORG", "PER"]
    assert labels.tolist() == [1, 2, 0, 1]


# ------------------------------------------------------------------------------------------------- readers


def _write(path, text):
    path.write_text(text)
    return path


CONLL = ("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\n\n"
         "Peter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n")


def test_conll_reader_spaces_tabs_docstart_and_tag_column(tmp_path):
    folder = tmp_path / "ner"
    folder.mkdir()
    _write(folder / "train.txt", CONLL)
    _write(folder / "dev.txt", CONLL.replace(" ", "\t"))
    _write(folder / "test.conll", "Peter NNP B-NP B-PER\n\nEU NNP B-NP B-ORG\n")
    loaded = load_source(str(folder), tmp_path, task="tagging")
    assert loaded.kind == "tagging" and loaded.label_names == ["O", "B-ORG", "B-PER", "I-PER"]
    train = loaded.splits["train"]
    assert train["tokens"] == [["EU", "rejects"], ["Peter", "Blackburn"]]
    assert train["tags"] == [[1, 0], [2, 3]] and train["text"] == ["EU rejects", "Peter Blackburn"]
    assert loaded.splits["validation"]["tokens"] == train["tokens"]
    assert len(loaded.splits["test"]) == 2
    chunks = load_source(str(folder / "train.txt"), tmp_path, task="tagging", columns={"tags": "2"},
                         test_fraction=0.5)
    assert chunks.label_names == ["B-NP", "I-NP", "B-VP"]  # fedlm split the file: the tags of all of it


def test_tagged_jsonl_and_a_plain_file_split_by_sentence(tmp_path):
    lines = [{"tokens": words, "tags": [TAGS[t] for t in tags]} for words, tags in SENTENCES]
    path = _write(tmp_path / "ner.jsonl", "\n".join(json.dumps(line) for line in lines) + "\n")
    loaded = load_source(str(path), tmp_path, task="tagging", test_fraction=0.25)
    assert len(loaded.splits["train"]) + len(loaded.splits["test"]) == len(SENTENCES)
    assert "whole sentences" in loaded.split_note
    assert set(loaded.label_names) == set(TAGS)


@pytest.mark.parametrize(("content", "columns", "message"), [
    ("EU NNP B-ORG\nrejects VBZ\n", None, r"train\.txt line 2: 2 columns, but the first token line has 3"),
    ("EU B-ORG\nrejects O\n", {"tags": "4"}, r"train\.txt line 1: tags column 4 does not exist: the lines have 2"),
    ("EU\nrejects\n", None, "line 1: one column only"),
])
def test_bad_conll_is_one_line_naming_file_and_line(tmp_path, content, columns, message):
    path = _write(tmp_path / "train.txt", content)
    with pytest.raises(UserError, match=message) as error:
        load_source(str(path), tmp_path, task="tagging", columns=columns)
    assert "\n" not in str(error.value)


def test_test_tag_unseen_in_training_names_it(tmp_path):
    _write(tmp_path / "train.txt", "EU B-ORG\nrejects O\n")
    _write(tmp_path / "test.txt", "Peter B-PER\n")
    with pytest.raises(UserError, match=r"test\.txt sentence 1: tag 'B-PER' does not occur in the training data"):
        load_source(str(tmp_path), tmp_path, task="tagging")


def test_tagging_needs_tagged_data():
    with pytest.raises(UserError, match=r"task = 'tagging' needs tagged sentences .* the data source is "
                                        r"classification data"):
        resolve_task("tagging", "classification", "bert")
    assert resolve_task("auto", "tagging", "gpt2") == "tagging"


def test_named_tagging_datasets():
    conll = load_source("conll2003", SHARED_DATA, max_train_examples=30, max_test_examples=10)
    assert conll.kind == "tagging" and len(conll.label_names) == 9 and conll.label_names[0] == "O"
    assert set(conll.splits) == {"train", "validation", "test"}
    ncbi = load_source("ncbi-disease", SHARED_DATA, max_train_examples=30, max_test_examples=10)
    assert ncbi.label_names == ["O", "B-Disease", "I-Disease"]
    part = partition_input(conll, "train")
    assert part.labels is not None and part.labels.max() <= 4  # no entity + LOC, MISC, ORG, PER


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_loss_equals_the_hf_token_classification_loss(tokenizers, family):
    task = get_task("tagging", label_names=TAGS)
    batch = task.collate(task.preprocess(_dataset(), tokenizers[family], 32).to_list(), torch.Generator())
    model = _model(family, tokenizers).eval()
    ours, count = task.loss(model, batch)
    assert count == int((batch["labels"] != IGNORE_INDEX).sum())
    torch.testing.assert_close(ours, model(**batch).loss, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_a_few_central_steps_lower_the_loss(tokenizers, family):
    task = get_task("tagging", label_names=TAGS)
    rows = task.preprocess(_dataset(), tokenizers[family], 32).to_list()
    model = _model(family, tokenizers).train()
    losses, count = central_steps(task, model, task.collate(rows, torch.Generator()))
    assert count == sum(len(tags) for _, tags in SENTENCES)
    assert losses[-1] < 0.5 * losses[0]
    scores = task.evaluate(model, rows, 8, torch.Generator())
    assert scores["f1"] > 0.5 and set(scores) == set(task.metric_names)


@pytest.mark.parametrize("cut", [Cut(0, 0), Cut(1, 1)], ids=["k0m0", "k1m1"])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_step_equals_unsplit_step(tokenizers, family, cut):
    task = get_task("tagging", label_names=TAGS)
    rows = task.preprocess(_dataset(), tokenizers[family], 32).to_list()[:6]
    batch = task.collate(rows, torch.Generator())
    assert_split_step_equals_unsplit(task, batch, _model(family, tokenizers, layers=3).train(), cut)


def _config(tmp_path, name, kind, clients=1, rounds=1, family="bert"):
    return validate({
        "name": name, "seed": 3, "output_dir": str(tmp_path / "runs"), "task": "tagging",
        "data": {"source": "conll2003", "max_train_examples": 48, "max_test_examples": 16},
        "partition": {"kind": "iid", "num_clients": clients},
        "model": {"family": family, "preset": "tiny", "vocab_size": 300, "max_length": 48},
        "train": {"lr": 0.003, "batch_size": 8},
        "protocol": {"kind": kind, "rounds": rounds}, "eval": {"batch_size": 16},
    })


def test_one_client_fedavg_equals_centralized_on_conll(tmp_path):
    records = one_client_fedavg_equals_centralized(lambda kind: _config(tmp_path, kind, kind), SHARED_DATA, tmp_path)
    fed_records, central_records = records["fedavg"], records["centralized"]
    assert fed_records[-1]["test_f1"] == pytest.approx(central_records[-1]["test_f1"], abs=1e-9)
    assert fed_records[0]["round"] == 0 and "test_f1" in fed_records[0]  # the starting point


def test_cli_runs_tagging_end_to_end_with_label_skew(tmp_path):
    raw = _config(tmp_path, "ner", "fedavg", clients=2, rounds=1, family="gpt2").model_dump(mode="json")
    raw["partition"] = {"kind": "label_dirichlet", "num_clients": 2, "alpha": 0.5}
    cli_run(raw, tmp_path / "ner.yaml", SHARED_DATA)
    run_dir = tmp_path / "runs" / "ner"
    records = read_metrics(run_dir)
    assert [r["round"] for r in records] == [0, 1] and np.isfinite(records[-1]["test_f1"])
    assert "f1" in (run_dir / "summary.md").read_text()
    data = json.loads((run_dir / "data.json").read_text())
    assert data["task"] == "tagging" and data["label_names"][0] == "O"
