"""Multiple-choice scoring by log-likelihood (lm-eval style): the per-option log-likelihoods against a hand
computation on tiny random decoders, acc vs acc_norm, the rows it trains on, its refusals, PubMedQA."""

from __future__ import annotations

import math

import datasets
import pytest
import torch

from fedlm.config.experiment import ExperimentConfig
from fedlm.data.sources import load_source, resolve_data_dir
from fedlm.errors import UserError
from fedlm.models.build import build_model, build_tokenizer
from fedlm.run.prepare import build_task, resolve_task
from fedlm.tasks import get_task
from fedlm.tasks.base import IGNORE_INDEX
from fedlm.tasks.choice import PAIR_PROMPT, choice_loglikelihoods, choice_scores

TEXTS = [
    "is the drug safe for children", "the trial found fewer deaths in the treated group", "yes", "no", "maybe",
    "does smoking cause cancer of the lung", "patients were followed for five years after surgery",
    "the answer is not clear from this small study", "Context:", "Question:", "Answer:",
]
DECODERS = ("gpt2", "llama")


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {family: build_tokenizer(None, family, TEXTS * 4, 200) for family in (*DECODERS, "bert")}


def _model(family: str, tokenizers: dict) -> torch.nn.Module:
    return build_model(family, "tiny", "clm", tokenizers[family], seed=0).eval()


def _hand_loglikelihood(model: torch.nn.Module, prompt: list[int], option: list[int]) -> float:
    """log P(option | prompt) from the model's own logits over the whole sequence: log_softmax by hand."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[*prompt, *option]])).logits[0].double()
    logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return sum(logprobs[len(prompt) - 1 + j, token].item() for j, token in enumerate(option))


@pytest.mark.parametrize("family", DECODERS)
def test_loglikelihoods_match_a_hand_computation(tokenizers, family):
    tok, model = tokenizers[family], _model(family, tokenizers)
    prompt = tok("does smoking cause cancer of the lung Answer:")["input_ids"]
    options = [tok(" yes", add_special_tokens=False)["input_ids"], tok(" no", add_special_tokens=False)["input_ids"],
               tok(" the answer is not clear", add_special_tokens=False)["input_ids"]]
    assert len({len(ids) for ids in options}) > 1  # padded together: lengths differ
    with torch.no_grad():
        scores, counts = choice_loglikelihoods(model, tok, prompt, options)
    assert counts == [len(ids) for ids in options]
    for score, option in zip(scores, options, strict=True):
        assert score == pytest.approx(_hand_loglikelihood(model, prompt, option), abs=1e-5)
        assert score < 0


def test_acc_norm_divides_by_option_characters():
    # item 0: "no" (2 chars) -3.0 vs "maybe not" (9 chars) -4.5: acc picks "no", acc_norm -1.5 vs -0.5 picks "maybe not"
    # item 1: both agree on option 0
    scores = choice_scores([[-3.0, -4.5], [-1.0, -2.0, -9.0]], [[2, 9], [3, 2, 5]], [1, 0])
    assert scores == {"acc": 0.5, "acc_norm": 1.0}
    assert math.isnan(choice_scores([], [], [])["acc"])


def _pubmed_like(rows: int = 6) -> datasets.Dataset:
    names = ["yes", "no", "maybe"]
    features = datasets.Features({"text": datasets.Value("string"), "text_pair": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=names)})
    return datasets.Dataset.from_dict({
        "text": [TEXTS[0], TEXTS[5]] * (rows // 2),
        "text_pair": [TEXTS[1], TEXTS[6]] * (rows // 2),
        "label": [i % 3 for i in range(rows)],
    }, features=features)


@pytest.mark.parametrize("family", DECODERS)
def test_rows_train_on_the_right_option_only(tokenizers, family):
    tok = tokenizers[family]
    task = get_task("multiple_choice", options=["yes", "no", "maybe"])
    rows = task.preprocess(_pubmed_like(), tok, 256).to_list()
    prompt_text = PAIR_PROMPT.format(text=TEXTS[0], pair=TEXTS[1])
    prompt = tok(prompt_text)["input_ids"]
    row = rows[4]  # the first item's text, label 1: "no"
    assert row["input_ids"][: row["prompt_length"]] == prompt
    assert row["option_ids"][1] == tok(prompt_text + " no")["input_ids"][len(prompt):]
    assert row["input_ids"] == [*prompt, *row["option_ids"][1]]
    assert row["option_chars"] == [3, 2, 5]
    batch = task.collate(rows[:2], torch.Generator())
    for i, r in enumerate(rows[:2]):
        labelled = batch["labels"][i][batch["labels"][i] != IGNORE_INDEX].tolist()
        assert labelled == r["option_ids"][r["label"]]
    model = _model(family, tokenizers)
    loss, count = task.loss(model, batch)
    assert count == sum(len(r["option_ids"][r["label"]]) for r in rows[:2]) and torch.isfinite(loss)
    # the head runs at the answer's positions only; the loss is the one over the model's full logits
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
    assert loss.item() == pytest.approx(reference.item(), abs=1e-5)
    loss.backward()


@pytest.mark.parametrize("family", DECODERS)
def test_evaluate_scores_every_option(tokenizers, family):
    """evaluate() agrees with the pure functions, item by item, across batches of mixed option counts."""
    tok, model = tokenizers[family], _model(family, tokenizers)
    task = get_task("multiple_choice")
    ds = datasets.Dataset.from_dict({
        "text": ["is the drug safe Answer:", "does smoking cause cancer Answer:", "is it clear Answer:"],
        "options": [["yes", "no"], ["yes", "no", "the answer is not clear"], ["maybe", "no", "yes"]],
        "label": [0, 2, 1],
    })
    rows = task.preprocess(ds, tok, 64).to_list()
    # one item's options made one token each, as " yes" / " no" are to a real tokenizer: it is scored from the
    # prompt's next-token distribution, the others option by option; both ways in one batch
    first = rows[0]
    first["option_ids"] = [[7], [11]]
    first["input_ids"] = [*first["input_ids"][: first["prompt_length"]], 7]
    lls, chars, nll, count = [], [], 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt = row["input_ids"][: row["prompt_length"]]
            scores, counts = choice_loglikelihoods(model, tok, prompt, row["option_ids"])
            lls.append(scores)
            chars.append(row["option_chars"])
            nll -= scores[row["label"]]
            count += counts[row["label"]]
    result = task.evaluate(model, rows, batch_size=2, generator=torch.Generator())
    expected = choice_scores(lls, chars, [row["label"] for row in rows])
    assert result["acc"] == expected["acc"] and result["acc_norm"] == expected["acc_norm"]
    with torch.no_grad():
        fast = task._eval_part(model, rows, {})["loglikelihoods"]
    assert fast == [pytest.approx(ll, abs=1e-5) for ll in lls]
    assert result["loss"] == pytest.approx(nll / count, abs=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert set(result) == {"acc", "acc_norm", "loss", "perplexity"}


def test_long_prompts_keep_their_end(tokenizers):
    tok = tokenizers["gpt2"]
    task = get_task("multiple_choice", options=["yes", "no", "maybe"])
    row = task.preprocess(_pubmed_like(2), tok, 12).to_list()[0]
    assert len(row["input_ids"]) <= 12
    assert row["input_ids"][: row["prompt_length"]] == tok(PAIR_PROMPT.format(text=TEXTS[0], pair=TEXTS[1]))[
        "input_ids"][-row["prompt_length"]:]


def test_metrics_selector():
    task = get_task("multiple_choice", metrics=["acc_norm"])
    assert task.metric_names == ("acc", "acc_norm")  # the headline stays
    assert set(task.evaluate(None, [], 4, torch.Generator())) == {"acc", "acc_norm"}
    with pytest.raises(UserError, match="unknown multiple_choice metric 'rouge'"):
        get_task("multiple_choice", metrics=["rouge"])


def test_bad_items_are_refused_in_one_line(tokenizers):
    tok = tokenizers["gpt2"]
    with pytest.raises(UserError, match=r"row 3: answer 5 is not among its 2 options") as bad:
        get_task("multiple_choice").preprocess(datasets.Dataset.from_dict(
            {"text": ["a", "b", "c", "d"], "options": [["yes", "no"]] * 4, "label": [0, 1, 0, 5]}), tok, 32)
    assert "\n" not in str(bad.value)
    with pytest.raises(UserError, match="row 0: needs two or more non-empty options"):
        get_task("multiple_choice").preprocess(datasets.Dataset.from_dict({"text": ["a"], "label": [0]}), tok, 32)
    with pytest.raises(UserError, match="row 1: needs two or more non-empty options"):
        get_task("multiple_choice").preprocess(datasets.Dataset.from_dict(
            {"text": ["a", "b"], "options": [["yes", "no"], ["yes", " "]], "label": [0, 0]}), tok, 32)


def test_encoder_only_models_are_refused(tokenizers):
    tok = tokenizers["bert"]
    model = build_model("bert", "tiny", "mlm", tok, seed=0).eval()
    with pytest.raises(UserError, match="needs a decoder-only \\(causal LM\\) model, not a 'bert' model"):
        choice_loglikelihoods(model, tok, [1, 2, 3], [[4], [5, 6]])


def test_resolve_task():
    assert resolve_task("multiple_choice", "classification", "gpt2") == "multiple_choice"
    with pytest.raises(UserError, match="multiple_choice"):
        resolve_task("multiple_choice", "seq2seq", "gpt2")


def test_pubmedqa_is_scored_yes_no_maybe(tokenizers):
    try:
        data_dir = resolve_data_dir()
    except UserError:
        pytest.skip("shared data directory not found (set FEDLM_DATA_DIR)")
    loaded = load_source("pubmedqa", data_dir)
    assert loaded.label_names == ["yes", "no", "maybe"] and len(loaded.splits["test"]) == 500
    tok, model = tokenizers["gpt2"], _model("gpt2", tokenizers)
    task = get_task("multiple_choice", options=loaded.label_names)
    rows = task.preprocess(loaded.splits["test"].select(range(4)), tok, 96).to_list()
    assert all(len(row["option_ids"]) == 3 and len(row["input_ids"]) <= 96 for row in rows)
    assert [row["label"] for row in rows] == loaded.splits["test"]["label"][:4]
    result = task.evaluate(model, rows, batch_size=2, generator=torch.Generator())
    assert 0 <= result["acc"] <= 1 and 0 <= result["acc_norm"] <= 1 and result["perplexity"] > 1


def test_build_task_passes_label_names_and_metrics(tmp_path):
    def config(task: str) -> ExperimentConfig:
        return ExperimentConfig.model_validate({
            "name": "mc", "output_dir": str(tmp_path), "task": task, "data": {"source": "pubmedqa"},
            "model": {"family": "gpt2", "preset": "tiny"}, "eval": {"metrics": ["acc_norm"]}})

    task = build_task(config("multiple_choice"), "multiple_choice", ["yes", "no", "maybe"])
    assert task.options == ["yes", "no", "maybe"] and task.metric_names == ("acc", "acc_norm")
    with pytest.raises(UserError, match=r"eval\.metrics selects multiple_choice, seq2seq and chat .* task is class"):
        build_task(config("classification"), "classification", ["yes", "no", "maybe"])


def test_a_federated_run_on_pubmedqa_is_scored_by_choice(tmp_path, one_thread):
    """``fedlm run`` end to end: two clients train a tiny causal LM on prompt + answer, every round scored by
    the options' log-likelihoods (the metrics chosen in eval.metrics)."""
    from fedlm.config import validate
    from fedlm.run.recorder import read_metrics
    from fedlm.run.single import run_single

    try:
        data_dir = resolve_data_dir()
    except UserError:
        pytest.skip("shared data directory not found (set FEDLM_DATA_DIR)")
    config = validate({
        "name": "mc", "output_dir": str(tmp_path), "task": "multiple_choice",
        "data": {"source": "pubmedqa", "max_train_examples": 16, "max_test_examples": 8},
        "partition": {"kind": "iid", "num_clients": 2}, "model": {"family": "gpt2", "preset": "tiny",
                                                                  "vocab_size": 300, "max_length": 64},
        "train": {"batch_size": 8}, "protocol": {"kind": "fedavg", "rounds": 1},
        "eval": {"metrics": ["acc_norm", "perplexity"], "local": False}})
    run_single(config, data_dir, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert [r["round"] for r in records] == [0, 1]
    assert {"test_acc", "test_acc_norm", "test_perplexity"} <= records[1].keys() and "test_loss" not in records[1]
