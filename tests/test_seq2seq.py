"""Seq2seq: ROUGE, the prompted decoder's target-only loss, both model kinds training, decoding, federated and
split equivalences, data errors, and a run on real DialogSum dialogues."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F

from fedlm import metrics
from fedlm.cli import main
from fedlm.config import validate
from fedlm.data.sources import load_source
from fedlm.errors import UserError
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.cut import Cut
from fedlm.run.prepare import build_task, resolve_task
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from fedlm.tasks import Seq2SeqTask, get_task
from fedlm.tasks.base import IGNORE_INDEX, base_hidden, iter_rows
from tests.conftest import SHARED_DATA
from tests.split_helpers import assert_split_step_equals_unsplit
from tests.tiny_models import LAYER_FIELD
from tests.training_helpers import final_weights, one_client_fedavg_equals_centralized

pytestmark = pytest.mark.usefixtures("one_thread")

ITEMS = ["tea", "coffee", "milk", "water", "juice", "soup", "bread", "rice"]
ENCODER_DECODERS = ("t5", "bart")
FAMILIES = ("gpt2", "llama", "t5", "bart")


def make_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """A toy summarisation task: the target names what the first speaker asks for."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        wanted, other = rng.sample(ITEMS, 2)
        agrees = rng.random() < 0.5
        rows.append({"src": f"A: I would like {wanted}, not {other}. B: {'okay' if agrees else 'no'}, {wanted}.",
                     "tgt": f"A wants {wanted}" + (" and B agrees." if agrees else ".")})
    return rows


PAIRS = make_pairs(48)
TEXTS = [row["src"] for row in PAIRS] + [row["tgt"] for row in PAIRS]
DATA = datasets.Dataset.from_dict({"text": [r["src"] for r in PAIRS], "target": [r["tgt"] for r in PAIRS]})


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {family: build_tokenizer(None, family, TEXTS, 400) for family in FAMILIES}


def _task(family: str, tokenizers: dict, **options) -> tuple[Seq2SeqTask, list[dict]]:
    task = get_task("seq2seq", encoder_decoder=family in ENCODER_DECODERS, max_new_tokens=12, **options)
    return task, task.preprocess(DATA, tokenizers[family], 64).to_list()


def _model(family: str, tokenizers: dict, seed: int = 0, **overrides):
    return build_model(family, "tiny", "seq2seq", tokenizers[family], overrides=overrides, seed=seed)


# ------------------------------------------------------------------------------------------------- ROUGE


def test_rouge_matches_hand_computed_scores_with_stemming():
    reference = "The cats are sitting on the mat."
    # stems: the cat are sit on the mat (7) vs a cat sat on the mat (6): unigrams in common cat, on, the, mat
    # (4: "cats" counts only through stemming); bigrams on-the, the-mat (2 of 5 / 6); LCS cat on the mat (4).
    # The second prediction reorders: same unigrams and bigrams, LCS on the mat (3).
    scores = metrics.rouge(["a cat sat on the mat", "on the mat a cat sat"], [reference, reference])
    f1 = lambda overlap, pred, ref: 2 * overlap / (pred + ref)  # noqa: E731 (F-measure from counts)
    assert scores["rouge1"] == pytest.approx(f1(4, 6, 7))  # 8/13
    assert scores["rouge2"] == pytest.approx(f1(2, 5, 6))  # 4/11
    assert scores["rougeL"] == pytest.approx((f1(4, 6, 7) + f1(3, 6, 7)) / 2)  # (8/13 + 6/13) / 2
    assert metrics.rouge(["a b"], ["c d"]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}


def test_eval_metrics_add_exact_match_f1_and_perplexity_to_generation():
    task = Seq2SeqTask(metrics=["exact_match", "f1", "perplexity"])
    assert task.metric_names == ("perplexity", "rougeL", "exact_match", "f1")  # the headline stays
    parts = [{"loss_sum": 4.0, "count": 2, "predictions": ["Yes.", "no"], "references": ["yes", "maybe"]},
             {"loss_sum": 2.0, "count": 1, "predictions": ["a blue car"], "references": ["the red car"]}]
    scores = task._summarize(parts)
    # SQuAD normalisation: "Yes." = "yes"; "blue car" vs "red car": one word in common, precision = recall = 1/2
    assert scores["exact_match"] == pytest.approx(1 / 3) and scores["f1"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert scores["perplexity"] == pytest.approx(torch.tensor(2.0).exp().item())  # mean token loss 6 / 3
    assert set(scores) == set(task.metric_names)
    with pytest.raises(UserError, match="unknown seq2seq metric 'acc'; choose from loss, perplexity, rouge1"):
        Seq2SeqTask(metrics=["acc"])


# ------------------------------------------------------------------------------------------ rows and loss


def test_prompted_rows_hold_source_separator_target_and_end(tokenizers):
    tok = tokenizers["gpt2"]
    task, rows = _task("gpt2", tokenizers)
    row = rows[0]
    source = tok(PAIRS[0]["src"])["input_ids"]
    target = tok(PAIRS[0]["tgt"], add_special_tokens=False)["input_ids"][:11]  # max_new_tokens - 1, then </s>
    assert row["input_ids"] == [*source, tok.eos_token_id, *target, tok.eos_token_id]
    assert row["prompt_length"] == len(source) + 1 and row["reference"] == PAIRS[0]["tgt"]
    batch = task.collate(rows[:4], torch.Generator())
    labelled = batch["labels"][0] != IGNORE_INDEX
    assert labelled.nonzero().flatten().tolist() == list(range(len(source) + 1, len(row["input_ids"])))


def test_decoder_only_loss_ignores_source_tokens(tokenizers):
    task, rows = _task("gpt2", tokenizers)
    model = _model("gpt2", tokenizers).eval()
    batch = task.collate(rows[:6], torch.Generator())
    with torch.no_grad():
        hidden = base_hidden(model, batch)
        loss, count = task.loss_from_hidden(model, hidden, batch)
        # by hand: next-token cross-entropy summed over target tokens (and the final </s>) only
        logits = model.lm_head(hidden)
        total, tokens = 0.0, 0
        for i, row in enumerate(rows[:6]):
            for t in range(row["prompt_length"], len(row["input_ids"])):
                total += F.cross_entropy(logits[i, t - 1], torch.tensor(row["input_ids"][t]), reduction="sum")
                tokens += 1
        assert count == tokens
        torch.testing.assert_close(loss, total / tokens, rtol=0, atol=1e-5)
        # scrambling every source position's hidden state (hence its logits) leaves the loss unchanged ...
        source = torch.arange(hidden.shape[1])[None, :, None] < torch.tensor(
            [row["prompt_length"] - 1 for row in rows[:6]])[:, None, None]
        noisy = torch.where(source, torch.randn_like(hidden) * 5, hidden)
        assert torch.equal(task.loss_from_hidden(model, noisy, batch)[0], loss)
        torch.testing.assert_close(task.loss(model, batch)[0], loss, rtol=0, atol=1e-5)  # the whole-model path
        # ... while changing the logits at one position that predicts a target token does change it
        last = torch.zeros_like(source)
        last[0, rows[0]["prompt_length"]] = True
        assert not torch.equal(task.loss_from_hidden(model, torch.where(last, hidden * 3, hidden), batch)[0], loss)


def test_encoder_decoder_loss_is_the_models_own_label_loss(tokenizers):
    for family in ENCODER_DECODERS:
        task, rows = _task(family, tokenizers)
        model = _model(family, tokenizers).eval()
        batch = task.collate(rows[:5], torch.Generator())
        assert (batch["labels"] == IGNORE_INDEX).any(), "targets of several lengths pad with IGNORE_INDEX"
        with torch.no_grad():
            ours, count = task.loss(model, batch)
            theirs = model(**batch).loss  # HF shifts the labels itself and averages over labelled tokens
        assert count == int((batch["labels"] != IGNORE_INDEX).sum())
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_central_steps_lower_the_loss(tokenizers, family):
    task, rows = _task(family, tokenizers)
    model = _model(family, tokenizers)
    generator = torch.Generator().manual_seed(0)
    before = task.evaluate(model, rows, 16, generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(3):
        for chunk in iter_rows(rows, 8):
            loss, _ = task.loss(model, task.collate(chunk, generator))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    after = task.evaluate(model, rows, 16, generator)
    assert after["loss"] < before["loss"] - 0.5
    assert set(after) == {"loss", "rouge1", "rouge2", "rougeL"}
    assert all(0.0 <= after[name] <= 1.0 for name in metrics.ROUGE_TYPES)


# --------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("family", ["gpt2", "t5"])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_batched_decoding_equals_one_at_a_time(tokenizers, family, num_beams):
    """Left padding (decoders) and right padding (encoders) must not change what a prompt decodes to."""
    task, rows = _task(family, tokenizers, num_beams=num_beams)
    rows = sorted(rows[:6], key=lambda row: len(row["input_ids"]))  # prompts of different lengths
    model = _model(family, tokenizers, seed=3)
    batched = task.evaluate(model, rows, 6, torch.Generator())
    calls = []
    single = task.evaluate(model, rows, 1, torch.Generator(), on_batch=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 6) for i in range(1, 7)]  # one progress call per generated batch
    for name in metrics.ROUGE_TYPES:
        assert batched[name] == pytest.approx(single[name], abs=1e-9)
    model.eval()
    together = task._eval_batch(model, task.eval_collate(rows, torch.Generator()))
    alone = [task._eval_batch(model, task.eval_collate([row], torch.Generator())) for row in rows]
    assert together["predictions"] == [part["predictions"][0] for part in alone]
    assert together["references"] == [row["reference"] for row in rows]


def test_generation_stops_at_the_length_limit(tokenizers):
    tok = tokenizers["llama"]
    task, rows = _task("llama", tokenizers)
    model = _model("llama", tokenizers, seed=1).eval()
    batch = task.eval_collate(rows[:4], torch.Generator())
    predictions = task._eval_batch(model, batch)["predictions"]
    with torch.no_grad():  # plain greedy decoding with transformers, run for twice the limit
        out = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], do_sample=False,
                             max_new_tokens=2 * task.decoding.max_new_tokens, pad_token_id=tok.pad_token_id)
    continuation = out[:, batch["prompt_ids"].shape[1]:]
    # an untrained model rarely says end-of-text, so the limit is what ends its continuations
    assert continuation.shape[1] > task.decoding.max_new_tokens
    limited = continuation[:, : task.decoding.max_new_tokens]
    assert predictions == tok.batch_decode(limited, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------- split


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("cut", [Cut(0, 0), Cut(1, 1)], ids=["k0m0", "k1m1"])
def test_decoder_only_split_step_equals_the_unsplit_step(tokenizers, family, cut):
    task, rows = _task(family, tokenizers)
    batch = task.collate(rows[:6], torch.Generator())
    reference = _model(family, tokenizers, **{LAYER_FIELD[family]: 3}).train()
    sent = assert_split_step_equals_unsplit(task, batch, reference, cut)  # labels stay with the client's top
    assert set(sent.to_dict()) == {"hidden", "attention_mask", "position_ids"}


def test_decoder_only_seq2seq_runs_by_split_learning(tmp_path):
    source = _write_jsonl(tmp_path / "d.jsonl", PAIRS)
    raw = _config(tmp_path, source, "llama") | {"split": {"bottom_blocks": 0, "top_blocks": 0}}
    raw["partition"]["num_clients"] = 2
    run_single(validate(raw), tmp_path, tmp_path / "split")
    last = read_metrics(tmp_path / "split")[-1]
    assert last["bytes_up_boundary"] > 0 and 0.0 <= last["test_rougeL"] <= 1.0
    assert last["test_loss"] < read_metrics(tmp_path / "split")[0]["test_loss"]


def test_encoder_decoder_split_is_refused_in_one_line(tmp_path):
    for family in ENCODER_DECODERS:
        raw = _config(tmp_path, tmp_path / "x.jsonl", family) | {"split": {"bottom_blocks": 0, "top_blocks": 0}}
        with pytest.raises(UserError, match=f"{family} is an encoder-decoder") as error:
            validate(raw)
        assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ data and runs


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _config(tmp_path: Path, source: Path, family: str, **protocol) -> dict:
    return {
        "name": family, "seed": 3, "output_dir": str(tmp_path / "runs"), "task": "seq2seq",
        "data": {"source": str(source), "columns": {"text": "src", "target": "tgt"}, "test_fraction": 0.25},
        "partition": {"kind": "iid", "num_clients": 1},
        "model": {"family": family, "preset": "tiny", "vocab_size": 300, "max_length": 48},
        "train": {"lr": 0.003, "batch_size": 8},
        "protocol": {"kind": "fedavg", "rounds": 1, **protocol},
        "generation": {"max_new_tokens": 12},
        "eval": {"batch_size": 16},
    }


def test_jsonl_and_csv_map_source_and_target_columns(tmp_path):
    jsonl = load_source(str(_write_jsonl(tmp_path / "d.jsonl", PAIRS)), tmp_path, columns={"text": "src",
                                                                                          "target": "tgt"})
    csv = tmp_path / "d.csv"
    csv.write_text("src,tgt\n" + "".join(f"\"{r['src']}\",{r['tgt']}\n" for r in PAIRS))
    from_csv = load_source(str(csv), tmp_path, columns={"text": "src", "target": "tgt"})
    for loaded in (jsonl, from_csv):
        assert loaded.kind == "seq2seq" and loaded.label_names is None
        split = loaded.splits["train"]
        assert set(split.column_names) == {"text", "target"}
        assert all(PAIRS[[p["src"] for p in PAIRS].index(t)]["tgt"] == g for t, g in zip(split["text"], split["target"],
                                                                                       strict=True))


def test_target_mapping_mistakes_are_one_line_errors(tmp_path):
    source = _write_jsonl(tmp_path / "d.jsonl", [{**row, "label": "x"} for row in PAIRS])
    with pytest.raises(UserError, match="both a label and a target column"):
        load_source(str(source), tmp_path, columns={"text": "src", "target": "tgt", "label": "label"})
    with pytest.raises(UserError, match=r"column 'summary' .*not found"):
        load_source(str(source), tmp_path, columns={"text": "src", "target": "summary"})
    with pytest.raises(UserError, match="needs source and target text"):
        resolve_task("seq2seq", "classification", "gpt2")
    raw = _config(tmp_path, source, "gpt2") | {"task": "classification"}
    raw["data"]["columns"] = {"text": "src", "label": "label"}
    with pytest.raises(UserError, match="generation is for seq2seq"):
        build_task(validate(raw), "classification")


def test_empty_target_is_one_line_and_exit_2(tmp_path, capsys):
    rows = [*make_pairs(10), {"src": "A: hello. B: hi.", "tgt": "  "}]
    source = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError, match=r"line 11.*empty target"):
        load_source(str(source), tmp_path, columns={"text": "src", "target": "tgt"})
    config = tmp_path / "bad.yaml"
    config.write_text(json.dumps(_config(tmp_path, source, "gpt2")))
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "empty target" in err and "bad.jsonl" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_fedavg_with_one_client_equals_centralized(tmp_path, family):
    source = _write_jsonl(tmp_path / "d.jsonl", PAIRS)
    records = one_client_fedavg_equals_centralized(
        lambda kind: validate(_config(tmp_path, source, family, kind=kind) | {"name": kind}), tmp_path, tmp_path)
    got = final_weights(tmp_path / "fedavg")
    for key in ("test_loss", "test_rougeL"):
        assert records["fedavg"][-1][key] == pytest.approx(records["centralized"][-1][key], abs=1e-6)
    assert records["fedavg"][0]["round"] == 0 and "test_rougeL" in records["fedavg"][0]  # the starting point
    # the saved model is a checkpoint of its family that fedlm (and plain transformers) load back
    saved = str(tmp_path / "fedavg" / "model")
    reloaded = build_model(family, None, "seq2seq", build_tokenizer(saved, family, None, 0), checkpoint=saved)
    assert reloaded.config.is_encoder_decoder == (family in ENCODER_DECODERS)
    for name, value in reloaded.state_dict().items():
        if name in got:
            torch.testing.assert_close(value, got[name], rtol=0, atol=0, msg=name)


@pytest.mark.skipif(not (SHARED_DATA / "dialogsum").is_dir(), reason="needs ../shared/data/dialogsum")
def test_fedlm_run_on_real_dialogsum_dialogues(tmp_path, capsys):
    raw = {
        "name": "dialogsum", "seed": 0, "output_dir": str(tmp_path / "runs"),
        "data": {"source": "dialogsum", "max_train_examples": 40, "max_test_examples": 8},
        "partition": {"kind": "iid", "num_clients": 2},
        "model": {"family": "gpt2", "preset": "tiny", "vocab_size": 500, "max_length": 96},
        "train": {"lr": 0.003, "batch_size": 8},
        "protocol": {"kind": "fedavg", "rounds": 1},
        "generation": {"max_new_tokens": 16, "num_beams": 2},
        "eval": {"batch_size": 8, "local": False},
    }
    config = tmp_path / "dialogsum.yaml"
    config.write_text(json.dumps(raw))
    assert main(["--data-dir", str(SHARED_DATA), "run", str(config)]) == 0
    run_dir = tmp_path / "runs" / "dialogsum"
    records = read_metrics(run_dir)
    assert [r["round"] for r in records] == [0, 1]
    assert records[1]["test_loss"] < records[0]["test_loss"]
    assert all(0.0 <= r["test_rougeL"] <= 1.0 for r in records)
    data = json.loads((run_dir / "data.json").read_text())
    assert data["task"] == "seq2seq"
    assert "rougeL" in (run_dir / "summary.md").read_text()
    assert "test_rougeL=" in capsys.readouterr().out
