"""Attacks are the clients' own doing: what an attacker uploads or trains on, hand-checked; a backdoor's success
rate measured every round; bad attack sections refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from fedlm.config import validate
from fedlm.errors import UserError
from fedlm.federation.attacks import Attack, chosen_clients
from fedlm.federation.client_round import fit_client
from fedlm.federation.codecs import get_codec
from fedlm.federation.executor import ClientJob
from fedlm.federation.local_training import LocalSettings
from fedlm.run.recorder import read_metrics
from fedlm.run.single import run_single
from tests.conftest import tiny_config

RECEIVED = {"w": torch.tensor([1.0, 1.0])}
TRAINED = {"w": torch.tensor([2.0, 0.5])}


def test_update_attacks_change_only_the_attackers_upload():
    scale = Attack("scale", frozenset({3}), scale=10.0)
    assert scale.corrupt(3, RECEIVED, TRAINED, seed=0)["w"].tolist() == [11.0, -4.0]  # 1 + 10 * (1, -0.5)
    assert scale.corrupt(2, RECEIVED, TRAINED, seed=0) is TRAINED  # an honest client sends what it trained
    flip = Attack("sign_flip", frozenset({3}), scale=1.0)
    assert flip.corrupt(3, RECEIVED, TRAINED, seed=0)["w"].tolist() == [0.0, 1.5]
    noise = Attack("noise", frozenset({3}), noise_std=2.0)
    sent = noise.corrupt(3, RECEIVED, TRAINED, seed=5)["w"]
    expected = RECEIVED["w"] + 2.0 * torch.randn(2, generator=torch.Generator().manual_seed(5))
    assert torch.equal(sent, expected) and torch.equal(noise.corrupt(3, RECEIVED, TRAINED, seed=5)["w"], sent)
    assert chosen_clients(None, 0.3, 10, seed=1) == chosen_clients(None, 0.3, 10, seed=1)
    assert len(chosen_clients(None, 0.3, 10, seed=1)) == 3 and chosen_clients([4], 0.9, 10, 1) == {4}


def test_data_attacks_poison_the_attackers_rows():
    rows = [{"input_ids": [101, 7, 8, 102], "token_type_ids": [0, 0, 0, 0], "labels": y} for y in (0, 1, 2, 1)]
    flipped = Attack("label_flip", frozenset({0})).poison(0, rows, num_labels=3, max_length=8, seed=0)
    assert [r["labels"] for r in flipped] == [2, 1, 0, 1] and [r["labels"] for r in rows] == [0, 1, 2, 1]
    backdoor = Attack("backdoor", frozenset({0}), trigger_ids=(55, 56), target_label=2, poison_share=0.5)
    poisoned = backdoor.poison(0, rows, num_labels=3, max_length=5, seed=0)
    changed = [i for i, (a, b) in enumerate(zip(rows, poisoned, strict=True)) if a != b]
    assert len(changed) == 2  # half of the rows
    for i in changed:  # the trigger after [CLS], cut to 5 tokens keeping [SEP]; the target label
        assert poisoned[i]["input_ids"] == [101, 55, 56, 7, 102] and poisoned[i]["labels"] == 2
        assert poisoned[i]["token_type_ids"] == [0, 0, 0, 0, 0]
    assert backdoor.poison(1, rows, 3, 5, 0) is rows  # an honest client trains on its own rows
    test = backdoor.triggered_test(rows, max_length=8)
    assert [r["input_ids"] for r in test] == [[101, 55, 56, 7, 8, 102]] * 3  # label 2 rows left out
    assert {r["labels"] for r in test} == {2}


def test_fit_client_uploads_the_attacked_update(tiny_csv, tmp_path, one_thread):
    """The attack sits in the client's own round (the simulator and a Flower node both run ``fit_client``)."""
    from fedlm.run.prepare import prepare

    prep = prepare(validate(tiny_config(tmp_path, tiny_csv)), tiny_csv)
    codec = get_codec("fp32")
    start = {n: p.detach().clone() for n, p in prep.model.named_parameters()}
    job = ClientJob(1, 1, codec.encode(start), LocalSettings(lr=0.01, batch_size=8), seed=3)
    honest, _ = fit_client(prep.model, prep.task, prep.client_train[1], job, codec, None, [])
    attacker = Attack("scale", frozenset({1}), scale=4.0)
    scaled, _ = fit_client(prep.model, prep.task, prep.client_train[1], job, codec, None, [], attack=attacker)
    for name, value in honest.update.params.items():
        torch.testing.assert_close(scaled.update.params[name], start[name] + 4 * (value - start[name]))


def test_a_backdoor_run_reports_its_success_rate_each_round(tmp_path, tiny_csv, one_thread):
    raw = tiny_config(tmp_path, tiny_csv, rounds=2)
    raw["attack"] = {"kind": "backdoor", "clients": [1, 2], "trigger": "zz qq", "target_label": 1,
                     "poison_share": 1.0}
    run_dir = tmp_path / "run"
    summary = run_single(validate(raw), tiny_csv, run_dir)
    records = read_metrics(run_dir)
    assert all(0.0 <= r["attack_success_rate"] <= 1.0 for r in records)  # round 0 too: the clean start
    assert "final attack success" in summary and "max attack success" in summary
    assert json.loads((run_dir / "data.json").read_text())["attackers"] == [1, 2]


def test_bad_attack_sections_are_refused_in_one_line(tmp_path, tiny_csv):
    def attack(**section):
        return validate({**tiny_config(tmp_path, tiny_csv), "attack": section})

    with pytest.raises(UserError, match=r"attack.clients names client\(s\) \[4, 9\], but the run has clients 0 to 3"):
        attack(kind="scale", clients=[1, 4, 9])
    with pytest.raises(UserError, match="fraction"):
        attack(kind="scale", fraction=1.0)
    with pytest.raises(UserError, match="kind noise needs attackers"):
        attack(kind="noise")
    raw = tiny_config(tmp_path, tiny_csv)
    raw["data"]["columns"] = {"text": "sentence"}
    raw.update(task="mlm", attack={"kind": "label_flip", "fraction": 0.5})
    with pytest.raises(UserError, match=r"attack\.kind label_flip poisons class labels, and the task is mlm"):
        run_single(validate(raw), tiny_csv, tmp_path / "mlm")
