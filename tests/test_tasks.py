"""Tasks against independent computations: HF's own losses, masking statistics, hand-computed metrics."""

from __future__ import annotations

import math
import os

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedlm import metrics
from fedlm.errors import UserError
from fedlm.models.build import FAMILIES, build_model, build_tokenizer
from fedlm.tasks import TASKS, get_task
from fedlm.tasks.base import IGNORE_INDEX, pack_blocks, pad_ids
from fedlm.tasks.mlm import mask_tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENCODERS = ("bert", "roberta", "distilbert")
WORDS = ["the", "a", "farmer", "client", "server", "model", "trained", "shared", "weights", "boats"]
WORDS += ["river", "near", "every", "our", "gradient"]


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) + "." for _ in range(n)]


TEXTS = _sentences(60)


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {family: build_tokenizer(None, family, TEXTS, 300) for family in FAMILIES}


def _labelled(n: int = 24, pair: bool = False, regression: bool = False) -> datasets.Dataset:
    texts = _sentences(n, seed=1)
    columns = {"text": texts, "label": [float(i % 5) / 4 if regression else i % 3 for i in range(n)]}
    if pair:
        columns["text_pair"] = _sentences(n, seed=2)
    return datasets.Dataset.from_dict(columns)


def _lm_name(family: str) -> str:
    return "mlm" if family in ENCODERS else "clm"


def _prepared(family, task_name, tokenizers, max_length=16):
    tok = tokenizers[family]
    task = get_task(task_name)
    raw = datasets.Dataset.from_dict({"text": TEXTS}) if task_name in ("mlm", "clm") else _labelled(pair=True)
    model = build_model(family, "tiny", task_name, tok, num_labels=3, seed=0)
    return task, task.preprocess(raw, tok, max_length), model


# ------------------------------------------------------------------------------------- every family x task


@pytest.mark.parametrize(
    ("family", "task_name"),
    [(f, t) for f in FAMILIES for t in (_lm_name(f), "classification", "regression")],
)
def test_forward_backward_and_evaluate(tokenizers, family, task_name):
    task, data, model = _prepared(family, task_name, tokenizers)
    batch = task.collate(data.select(range(6)).to_list(), torch.Generator().manual_seed(0))
    loss, count = task.loss(model, batch)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert torch.isfinite(loss) and count > 0
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    scores = task.evaluate(model, data, 8, torch.Generator().manual_seed(0))
    assert set(scores) == set(task.metric_names)
    assert task.target_metric()[0] in scores
    assert math.isfinite(scores["loss"])


def test_registry():
    assert {"mlm", "clm", "classification", "regression", "tagging", "qa"} <= set(TASKS)
    assert get_task("tagging").target_metric() == ("f1", "max") and get_task("qa").target_metric() == ("f1", "max")
    assert get_task("classification", target="mcc").target_metric() == ("mcc", "max")
    assert get_task("clm").target_metric() == ("perplexity", "min")


# ---------------------------------------------------------------------------------------------- LM packing


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_pack_blocks_concatenates_and_drops_tail(tokenizers, family):
    tok = tokenizers[family]
    texts = ["the farmer trained", "", "  ", "our server shared weights near the river"]
    stream = []
    for text in (t for t in texts if t.strip()):
        ids = tok(text)["input_ids"]
        stream += ids + ([tok.eos_token_id] if tok.eos_token_id is not None and ids[-1] != tok.eos_token_id else [])
    blocks = pack_blocks(tok, texts, 4)
    assert [i for block in blocks for i in block] == stream[: len(stream) // 4 * 4]
    assert all(len(block) == 4 for block in blocks)


def test_lm_preprocess_is_in_memory_for_read_only_data(tmp_path, tokenizers):
    folder = tmp_path / "data"
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(folder)
    ds = datasets.load_from_disk(folder)
    folder.chmod(0o555)
    try:
        out = get_task("mlm").preprocess(ds, tokenizers["bert"], 16)
    finally:
        folder.chmod(0o755)
    assert out.cache_files == [] and out.column_names == ["input_ids"]
    assert {len(ids) for ids in out["input_ids"]} == {16}


# ----------------------------------------------------------------------------------------------------- MLM


@pytest.mark.parametrize("family", ENCODERS)
def test_masked_positions_loss_equals_hf_loss(tokenizers, family):
    tok = tokenizers[family]
    task = get_task("mlm", tok)
    model = build_model(family, "tiny", "mlm", tok, seed=2).eval()
    rows = [{"input_ids": tok(text)["input_ids"]} for text in TEXTS[:8]]  # ragged: exercises padding
    batch = task.collate(rows, torch.Generator().manual_seed(1))
    assert (batch["attention_mask"] == 0).any()
    ours, count = task.loss(model, batch)
    with torch.no_grad():
        reference = model(**batch).loss
    assert count == int((batch["labels"] != IGNORE_INDEX).sum()) > 0
    torch.testing.assert_close(ours.detach(), reference, rtol=1e-5, atol=1e-5)


def test_masking_statistics_and_exclusions(tokenizers):
    tok = tokenizers["roberta"]
    task = get_task("mlm", tok)
    special = torch.tensor(tok.all_special_ids)
    vocab = torch.arange(len(tok))
    ordinary = vocab[~torch.isin(vocab, special)]
    gen = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": [
                tok.bos_token_id,
                *ordinary[torch.randint(len(ordinary), (n,), generator=gen)],
                tok.eos_token_id,
            ]
        }
        for n in torch.randint(60, 128, (1000,), generator=gen).tolist()
    ]  # ~94k tokens, ragged so the batch has padding
    batch = task.collate(rows, torch.Generator().manual_seed(0))
    ids, labels = batch["input_ids"], batch["labels"]
    selected = labels != IGNORE_INDEX
    original = pad_ids([row["input_ids"] for row in rows], tok.pad_token_id)[0]
    maskable = (batch["attention_mask"] == 1) & ~torch.isin(original, special)
    assert not (selected & ~maskable).any()  # never specials, never padding
    assert torch.equal(labels[selected], original[selected])
    assert abs(selected.sum() / maskable.sum() - 0.15) < 0.01
    shown, truth = ids[selected], labels[selected]
    masked = (shown == tok.mask_token_id).float().mean()
    kept = (shown == truth).float().mean()  # includes the rare random pick that hits the original token
    assert abs(masked - 0.8) < 0.015 and abs(kept - 0.1) < 0.015 and abs(1 - masked - kept - 0.1) < 0.015
    assert not torch.isin(shown[shown != tok.mask_token_id], special).any()  # random picks are ordinary
    assert torch.equal(task.collate(rows, torch.Generator().manual_seed(0))["input_ids"], ids)  # reproducible
    assert torch.equal(ids[~selected], original[~selected])


def test_mask_tokens_is_reproducible_per_generator():
    ids = torch.arange(10, 1010).reshape(10, 100)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    replacement = torch.arange(10, 2000)

    def draw(seed: int):
        return mask_tokens(ids, maskable, 3, replacement, torch.Generator().manual_seed(seed))

    assert all(torch.equal(a, b) for a, b in zip(draw(5), draw(5), strict=True))
    assert not torch.equal(draw(5)[1], draw(6)[1])


def test_mask_rate_sets_training_share_and_evaluation_keeps_bert_rate(tokenizers):
    tok = tokenizers["roberta"]
    rows = [{"input_ids": [tok.cls_token_id, *range(10, 210), tok.sep_token_id]} for _ in range(50)]
    task = get_task("mlm", tok, mask_rate=0.4)

    def share(batch) -> float:
        return float((batch["labels"] != IGNORE_INDEX).float().mean())

    assert share(task.collate(rows, torch.Generator().manual_seed(0))) == pytest.approx(0.4, abs=0.01)
    assert share(task.eval_collate(rows, torch.Generator().manual_seed(0))) == pytest.approx(0.15, abs=0.01)
    with pytest.raises(UserError, match="mask_rate"):
        get_task("mlm", tok, mask_rate=1.5)


# ----------------------------------------------------------------------------------------------------- CLM


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_clm_loss_ignores_padding(tokenizers, family):
    tok = tokenizers[family]
    task = get_task("clm", tok)
    model = build_model(family, "tiny", "clm", tok, seed=0).eval()
    rows = [{"input_ids": tok(text)["input_ids"]} for text in TEXTS[:3]]
    batch = task.collate(rows, torch.Generator())
    loss, count = task.loss(model, batch)
    assert count == sum(len(row["input_ids"]) - 1 for row in rows)
    singles = [task.loss(model, task.collate([row], torch.Generator())) for row in rows]
    weighted = sum(single_loss * n for single_loss, n in singles) / sum(n for _, n in singles)
    torch.testing.assert_close(loss.detach(), weighted.detach(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        reference = model(**batch).loss  # HF shifts internally and skips -100 labels
    torch.testing.assert_close(loss.detach(), reference, rtol=1e-5, atol=1e-5)


def test_lm_evaluate_aggregates_exactly(tokenizers):
    task, data, model = _prepared("gpt2", "clm", tokenizers)
    model.train()
    scores = task.evaluate(model, data.to_list(), 5, torch.Generator())  # a list of rows works too
    assert model.training  # mode restored
    batches = [
        task.collate(data.select(range(i, min(i + 5, len(data)))).to_list(), torch.Generator())
        for i in range(0, len(data), 5)
    ]
    model.eval()
    with torch.no_grad():
        parts = [task.loss(model, batch) for batch in batches]
    expected = metrics.mean_loss([loss.item() for loss, _ in parts], [n for _, n in parts])
    assert scores["loss"] == pytest.approx(expected, rel=1e-5)
    assert scores["perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert 0 <= scores["accuracy"] <= 1


def test_evaluate_empty_dataset_gives_nan(tokenizers):
    task, _, model = _prepared("bert", "classification", tokenizers)
    scores = task.evaluate(model, [], 8, torch.Generator())
    assert set(scores) == set(task.metric_names) and all(math.isnan(v) for v in scores.values())


# ------------------------------------------------------------------------------------------ classification


def test_classification_pairs_loss_and_metrics(tokenizers):
    tok = tokenizers["bert"]
    task = get_task("classification")
    data = task.preprocess(_labelled(pair=True), tok, 12)
    assert set(data.column_names) == {"input_ids", "token_type_ids", "labels"}
    assert max(len(ids) for ids in data["input_ids"]) <= 12
    assert any(1 in types for types in data["token_type_ids"])
    model = build_model("bert", "tiny", "classification", tok, num_labels=3, seed=0).eval()
    batch = task.collate(data.to_list(), torch.Generator())
    loss, count = task.loss(model, batch)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert count == len(data)
    torch.testing.assert_close(loss.detach(), F.cross_entropy(logits, batch["labels"]))
    scores = task.evaluate(model, data, 7, torch.Generator())
    preds, labels = logits.argmax(-1).numpy(), np.array(data["labels"])
    assert scores["accuracy"] == pytest.approx((preds == labels).mean())
    assert scores["loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_regression_loss_is_mse(tokenizers):
    tok = tokenizers["llama"]
    task = get_task("regression")
    data = task.preprocess(_labelled(regression=True), tok, 16)
    model = build_model("llama", "tiny", "regression", tok, seed=0).eval()
    batch = task.collate(data.to_list(), torch.Generator())
    assert batch["labels"].dtype == torch.float32
    loss, _ = task.loss(model, batch)
    with torch.no_grad():
        preds = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(loss.detach(), ((preds - batch["labels"]) ** 2).mean())
    scores = task.evaluate(model, data, 5, torch.Generator())
    assert scores["loss"] == pytest.approx(metrics.mse(preds.numpy(), batch["labels"].numpy()), rel=1e-4)


def test_missing_label_column_is_a_user_error(tokenizers):
    unlabelled = datasets.Dataset.from_dict({"text": ["x"]})
    with pytest.raises(UserError, match="label"):
        get_task("classification").preprocess(unlabelled, tokenizers["bert"], 8)


# ------------------------------------------------------------------------------------------------ metrics


def test_metrics_match_hand_computed_values():
    preds = np.array([0, 1, 1, 0, 2, 2])
    labels = np.array([0, 1, 0, 0, 2, 1])
    assert metrics.accuracy(preds, labels) == pytest.approx(4 / 6)
    # per class F1: class 0 p=2/2 r=2/3 -> 0.8; class 1 p=1/2 r=1/2 -> 0.5; class 2 p=1/2 r=1 -> 2/3
    assert metrics.macro_f1(preds, labels) == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    binary_p, binary_l = np.array([1, 1, 0, 0, 1]), np.array([1, 0, 0, 0, 1])
    # tp=2 tn=2 fp=1 fn=0: (4 - 0) / sqrt(3 * 2 * 2 * 3)
    assert metrics.mcc(binary_p, binary_l) == pytest.approx(4 / 6)
    assert metrics.mcc(np.zeros(4), np.array([0, 1, 0, 1])) == 0.0

    x, y = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 3.0, 2.0, 5.0])
    assert metrics.mse(x, y) == pytest.approx((0 + 1 + 1 + 1) / 4)
    # r = cov / (sx sy): deviations x (-1.5,-.5,.5,1.5), y (-1.75,.25,-.75,2.25)
    assert metrics.pearson(x, y) == pytest.approx(5.5 / math.sqrt(5 * 8.75))
    assert metrics.spearman(x, y) == pytest.approx(1 - 6 * 2 / (4 * 15))  # rank diffs (0, 1, -1, 0)
    assert metrics.pearson(np.ones(4), y) == 0.0 and metrics.spearman(x, np.ones(4)) == 0.0

    assert metrics.mean_loss([2.0, 4.0], [1, 3]) == pytest.approx(3.5)
    assert metrics.perplexity(math.log(7.0)) == pytest.approx(7.0)
    assert metrics.perplexity(1e6) == math.inf
