"""Leakage audits: the inversion attack, update leakage, the exposure checks and `fedlm audit` on tiny runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

from fedlm.audit.boundary import boundary_set
from fedlm.audit.exposure import MessageLog, activation_violations, boundary_violations, upload_violations
from fedlm.audit.inversion import invert, train_inverter
from fedlm.audit.scores import bleu4, chance_accuracy, require_sacrebleu, set_precision_recall, token_accuracy
from fedlm.audit.target import cannot_audit
from fedlm.audit.update_leakage import Upload, changed_rows, embedding_name, fed_tokens, leakage
from fedlm.cli import main
from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.client_round import fit_client
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientJob
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import snapshot, trainable_names
from fedlm.models.cut import Activations, Cut, SplitModel
from fedlm.run.single import run_single
from fedlm.split.trunk import TO_CLIENT, TO_SERVER
from fedlm.tasks import get_task
from tests.conftest import make_sentences, tiny_config

VOCAB = 60


def _tiny_bert(seed: int = 0, layers: int = 2) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32, num_labels=2, pad_token_id=0)
    return BertForSequenceClassification(config)


def _word_tokenizer() -> PreTrainedTokenizerFast:
    """Token ``t<i>`` is id i; id 0 pads."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="t0")


def _random_batches(n: int, seq: int, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, seq), generator=generator)
    return [{"input_ids": ids[i : i + 16], "attention_mask": torch.ones_like(ids[i : i + 16])}
            for i in range(0, n, 16)]


def test_inversion_recovers_tokens_from_embedding_only_activations(one_thread):
    """Cut (0, 0) of an untrained model: the boundary is the embedding layer, so each position's vector is
    its token's row plus position terms, and an inverter fit on public text reads the private ids back."""
    bottom = SplitModel(_tiny_bert().eval(), Cut(0, 0)).bottom
    public = boundary_set(bottom, _random_batches(256, 12, seed=1), torch.float32)
    private = boundary_set(bottom, _random_batches(64, 12, seed=2), torch.float32)
    inverter = train_inverter(public, kind="mlp", steps=300, seed=0)
    accuracy = token_accuracy(invert(inverter, private), private.ids, private.mask)
    chance = chance_accuracy(public.ids, public.mask, private.ids, private.mask)
    assert chance < 0.1
    assert accuracy > 0.9, accuracy


def test_inversion_at_chance_when_activations_carry_no_tokens(one_thread):
    """The same attack on activations that do not depend on the tokens learns nothing: the accuracy above
    comes from the activations, not from the scoring."""
    bottom = SplitModel(_tiny_bert().eval(), Cut(0, 0)).bottom
    public = boundary_set(bottom, _random_batches(256, 12, seed=1), torch.float32)
    private = boundary_set(bottom, _random_batches(64, 12, seed=2), torch.float32)
    blank = type(public)(torch.zeros_like(public.hidden), public.ids, public.mask)
    inverter = train_inverter(blank, kind="transformer", steps=100, seed=0)
    target = type(private)(torch.zeros_like(private.hidden), private.ids, private.mask)
    assert token_accuracy(invert(inverter, target), private.ids, private.mask) < 0.1


def test_bleu4_and_set_scores():
    assert bleu4(["the cat sat on the mat today"], ["the cat sat on the mat today"]) == pytest.approx(100.0)
    assert bleu4(["a b c d e"], ["v w x y z"]) == pytest.approx(0.0)
    scores = set_precision_recall({1, 3, 5}, {1, 3, 4, 7})
    assert (scores["precision"], scores["recall"]) == (pytest.approx(2 / 3), pytest.approx(2 / 4))


def test_missing_sacrebleu_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu now raises ImportError
    with pytest.raises(UserError, match=r"fedlm\[audit\]"):
        require_sacrebleu()


def test_update_leakage_on_a_hand_built_update():
    before = torch.zeros(8, 4)
    after = before.clone()
    after[[1, 3, 5]] += torch.tensor([0.5, -1e-3, 2.0]).unsqueeze(1)
    assert changed_rows(before, after) == {1, 3, 5}
    assert changed_rows(before, after, tol=1e-2) == {1, 5}
    row = leakage(Upload(0, {"emb": before}, {"emb": after}), "emb", {1, 3, 4, 7})
    assert (row["precision"], row["recall"], row["correct"]) == (pytest.approx(2 / 3), 0.5, 2)
    assert leakage(Upload(0, {"emb": before}, {}), "emb", {1})["sent_embedding"] is False


def test_update_leakage_of_a_real_client_round_is_exactly_its_tokens(one_thread):
    """A hand-built client whose rows use known ids trains one FedAvg round (untied embeddings, no weight
    decay): the changed rows of its upload are exactly the ids it fed."""
    model = _tiny_bert()
    task = get_task("classification")
    task.bind(_word_tokenizer())
    rows = [{"input_ids": [2, 11, 17, 3], "labels": 0}, {"input_ids": [2, 23, 11, 40, 3], "labels": 1}]
    names = trainable_names(model)
    codec = get_codec("fp32")
    sent = codec.encode(snapshot(model, names))
    job = ClientJob(0, 1, sent, LocalSettings(lr=0.01, batch_size=2, weight_decay=0.0), seed=3)
    report, _ = fit_client(model, task, rows, job, codec, None, [])
    emb = embedding_name(model)
    row = leakage(Upload(0, codec.decode(sent), report.update.params), emb, fed_tokens(rows))
    assert fed_tokens(rows) == {2, 3, 11, 17, 23, 40}
    assert (row["precision"], row["recall"]) == (1.0, 1.0)
    assert not upload_violations(report.update.params, set(names), report.update.metrics)


def test_exposure_checks_catch_token_ids_and_labels():
    log = MessageLog()
    log(TO_SERVER, "0", "forward", {"hidden": ("float32", (2, 4, 8)), "attention_mask": ("int64", (2, 4))})
    log(TO_SERVER, "0", "backward", {"grad": ("float32", (2, 4, 8))})
    log(TO_CLIENT, "0", "forward", {"labels": ("int64", (2,))})  # to the client: not the server's
    assert boundary_violations(log) == []
    log(TO_SERVER, "0", "forward", {"input_ids": ("int64", (2, 4))})
    assert len(boundary_violations(log)) == 1
    ids = torch.tensor([[5, 9, 12, 7]])
    leak = Activations(torch.zeros(1, 4, 8), attention_mask=ids.clone())
    assert len(activation_violations(leak, ids)) == 2  # equals the ids, and is no 0/1 mask
    assert activation_violations(Activations(torch.zeros(1, 4, 8), torch.ones_like(ids)), ids) == []
    assert upload_violations({"labels": torch.tensor([1])}, {"w"}, {}) != []


def test_runs_with_no_server_message_are_refused(tmp_path, tiny_csv):
    for kind in ("isolated", "centralized"):
        config = validate(tiny_config(tmp_path, tiny_csv, kind=kind))
        assert "no message to audit" in cannot_audit(config)
    assert cannot_audit(validate(tiny_config(tmp_path, tiny_csv))) is None


@pytest.fixture(scope="module")
def public_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("public") / "public.txt"
    path.write_text("\n".join(text for text, _ in make_sentences(200, seed=11)) + "\n")
    return path


def _audit(run_dir: Path, data_dir: Path, public_text: Path, *extra: str) -> dict:
    code = main(["--data-dir", str(data_dir), "audit", str(run_dir), "--public-text", str(public_text),
                 "--steps", "60", "--public-sequences", "200", "--client-sequences", "16", "--clients", "0", "1",
                 *extra])
    assert code == 0
    assert (run_dir / "audit.md").is_file()
    return json.loads((run_dir / "audit.json").read_text())


def test_audit_cli_on_a_tiny_fedavg_run(tmp_path, tiny_csv, public_text, one_thread):
    raw = tiny_config(tmp_path, tiny_csv, rounds=1)
    run_dir = tmp_path / "fedavg"
    run_single(validate(raw), tiny_csv, run_dir)
    result = _audit(run_dir, tiny_csv, public_text)
    leak = result["update_leakage"]
    assert [r["client"] for r in leak["clients"]] == [0, 1]
    assert leak["recall"] == pytest.approx(1.0)  # every token a client fed moved its row
    assert leak["precision"] == pytest.approx(1.0)  # a classifier's embeddings are not the output layer
    assert result["exposure"]["violations"] == []
    assert "activation_inversion" not in result and result["round"] == 2


@pytest.mark.parametrize("kind", ["sample", "client"])
def test_audit_replays_a_dp_run_as_it_trained(tmp_path, tiny_csv, public_text, one_thread, kind):
    """DP-SGD noises every embedding row, so the recomputed upload names the whole vocabulary; DP-FedAvg's
    server clips and noises only after it has seen each update in the clear, so leakage stays exact."""
    raw = tiny_config(tmp_path, tiny_csv, rounds=1)
    raw["privacy"] = {"kind": kind, "noise_multiplier": 1.0}
    run_dir = tmp_path / f"dp-{kind}"
    run_single(validate(raw), tiny_csv, run_dir)
    leak = _audit(run_dir, tiny_csv, public_text)["update_leakage"]
    assert leak["recall"] == pytest.approx(1.0)
    for row in leak["clients"]:
        if kind == "sample":
            assert row["precision"] < 1.0 and row["recovered"] > row["true"]
        else:
            assert row["precision"] == pytest.approx(1.0) and row["recovered"] == row["true"]


@pytest.mark.parametrize("client_parts", ["average", "local"])
def test_audit_cli_on_a_tiny_split_run(tmp_path, tiny_csv, public_text, one_thread, client_parts):
    raw = tiny_config(tmp_path, tiny_csv, rounds=1)
    raw["split"] = {"bottom_blocks": 0, "top_blocks": 0, "client_parts": client_parts}
    run_dir = tmp_path / "split"
    run_single(validate(raw), tiny_csv, run_dir)
    result = _audit(run_dir, tiny_csv, public_text)
    inversion = result["activation_inversion"]
    shared = client_parts == "average"  # local: the server never sees a bottom, trained or not
    assert inversion["cut"] == [0, 0] and inversion["attacker_knows_trained_bottom"] is shared
    assert [r["sent_embedding"] for r in result["update_leakage"]["clients"]] == [shared, shared]
    for condition in ("untrained", "trained"):
        scores = inversion[condition]
        assert scores["sequences"] > 0 and 0 <= scores["token_accuracy"] <= 1 and scores["bleu4"] >= 0
    assert inversion["untrained"]["token_accuracy"] > inversion["untrained"]["chance_accuracy"]
    received = result["exposure"]["received"]
    assert received["boundary_messages"] > 0
    assert set(received["boundary"]) == {"forward", "backward"}
    assert set(received["boundary"]["forward"]) <= {"hidden", "attention_mask", "position_ids"}
    assert result["exposure"]["violations"] == []
    assert {r["client"] for r in result["update_leakage"]["clients"]} == {0, 1}


def test_audit_cli_refuses_a_directory_without_a_run(tmp_path, capsys):
    assert main(["audit", str(tmp_path)]) != 0
    assert "holds no run" in capsys.readouterr().err


def test_the_attack_is_seeded_by_the_run_unless_told(tmp_path, tiny_csv, public_text, one_thread):
    """A run under seed 3 is attacked under seed 3 (so seeds of a grid give independent attacks), reproducibly;
    --seed overrides it and draws a different inverter."""
    raw = tiny_config(tmp_path, tiny_csv, rounds=1)
    raw["seed"] = 3
    raw["split"] = {"bottom_blocks": 0, "top_blocks": 0, "client_parts": "local"}
    run_dir = tmp_path / "split"
    run_single(validate(raw), tiny_csv, run_dir)
    barely_trained = ("--steps", "3")  # a fully trained inverter scores 1.0 under any seed on this tiny model
    runs = [_audit(run_dir, tiny_csv, public_text, *barely_trained)["activation_inversion"] for _ in range(2)]
    other = _audit(run_dir, tiny_csv, public_text, *barely_trained, "--seed", "0")["activation_inversion"]
    assert [r["inverter_seed"] for r in (*runs, other)] == [3, 3, 0]
    assert runs[0]["untrained"] == runs[1]["untrained"]
    assert other["untrained"] != runs[0]["untrained"]
