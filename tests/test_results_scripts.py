"""The results scripts' verdict rules on hand-computed cases: the words a reproduction's md quotes come from these
functions, so a wrong side, a lost precondition or a selection of the wrong epoch would change a paper's verdict
without any run changing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

RESULTS = Path(__file__).resolve().parents[1] / "recipes" / "results"


@pytest.fixture(autouse=True)
def _results_scripts_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The results scripts import each other by bare name, as they do when run from recipes/results."""
    monkeypatch.syspath_prepend(str(RESULTS))


def _write_run(run_dir: Path, config: dict, records: list[dict] | None = None) -> None:
    """A finished run directory as fedlm writes it: its config, its metric records (if any) and a summary."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    if records is not None:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "summary.md").write_text("done\n")


def test_one_sided_verdicts_follow_the_interval_and_the_wanted_side() -> None:
    import fedsplitbert_long as long

    # mean 0.10, sd 0.02, t(0.975, 2) = 4.3027: half-width 0.0497
    text, word = long.interval([0.10, 0.12, 0.08])
    assert (text, word) == ("+0.100 [+0.050, +0.150] (3 seeds)", "above 0")
    assert long.verdict(word) == "holds"
    assert long.verdict(word, wanted="below 0") == "does not hold here"
    assert long.verdict(long.interval([0.05, -0.03, 0.01])[1]) == "within noise"
    assert long.interval([0.05]) == ("+0.050 (1 seed)", "not measurable")
    assert long.verdict("not measurable") == "not measurable here (fewer than 2 seeds)"
    assert long.verdict("above 0", precondition=False) == "not measurable here (precondition failed)"
    # no paired seed: "not run", which no precondition overrides
    assert long.interval([]) == ("not run", "not run")
    assert long.verdict("not run", precondition=False) == "not run"


def test_equivalence_holds_only_inside_the_band() -> None:
    import fedsplitbert_long as long

    from fedlm.run.seeds import equivalence

    # mean 0, sd 0.001: half-width 0.0025, inside a band of 0.015
    assert long.equivalence_verdict(equivalence([0.001, -0.001, 0.0], 0.015)) == "holds"
    # covers 0 but reaches past the band: no difference found, no equivalence shown
    assert long.equivalence_verdict(equivalence([0.03, -0.03, 0.0], 0.015)) == "within noise"
    assert long.equivalence_verdict(equivalence([0.05, 0.06, 0.04], 0.015)) == "does not hold here"
    assert long.equivalence_verdict(equivalence([0.001], 0.015)) == "not measurable here"
    assert long.equivalence_verdict(equivalence([], 0.015)) == "not run"


def test_joint_claims_and_curve_roughness() -> None:
    import fednlp_20news_table as news

    assert news.joint(["above 0", "above 0"], "above 0") == "holds"
    assert news.joint(["above 0", "covers 0"], "above 0") == "within noise"
    assert news.joint(["above 0", "below 0"], "above 0") == "does not hold here"
    assert news.joint(["below 0", "not measurable"], "below 0") == "not measurable here (fewer than 2 seeds)"
    assert news.joint(["below 0", "not run"], "below 0") == news.joint([], "below 0") == "not run"
    # round 0 (the start) is left out; the steps are +0.2, +0.1, +0.4: mean 0.2333, sample sd 0.15275
    records = [{"round": r, "test_accuracy": a} for r, a in enumerate([0.9, 0.1, 0.3, 0.4, 0.8])]
    records.insert(2, {"round": 1, "train_loss": 1.0})  # a record without the metric is skipped
    assert news.roughness(records) == pytest.approx(0.152753, abs=1e-6)
    assert news.paired({0: 3.0, 1: 5.0, 2: 1.0}, {0: 1.0, 2: 4.0}, float) == [2.0, -3.0]


def _ner_run(root: Path, model: str, seed: int, picked: float) -> None:
    """A finished fine-tuning run whose development F1 peaks at epoch 2, where its test F1 is ``picked``; the last
    epoch's test F1 is lower, so scoring the last epoch instead of the selected one changes every number."""
    curve = [(0.0, 0.0), (0.4, picked - 0.1), (0.6, picked), (0.5, picked - 0.05)]  # (dev, test) per epoch
    records = [{"round": epoch, "val_f1": dev, "test_f1": test} for epoch, (dev, test) in enumerate(curve)]
    _write_run(root / f"pretrained={model.replace(' ', '_')}_seed={seed}",
               {"tags": {"pretrained": model}, "seed": seed}, records)


def test_ner_rerun_scores_the_best_dev_epoch_and_judges_t0_t3_t2(tmp_path: Path, capsys) -> None:
    import fdapt_ner_select as ner

    original = [0.50, 0.52, 0.54]
    central = [o + d for o, d in zip(original, [0.10, 0.12, 0.08], strict=True)]
    fdapt = [c + d for c, d in zip(central, [0.001, -0.001, 0.0], strict=True)]
    for model, scores in ((ner.ORIGINAL, original), (ner.CENTRAL, central), (ner.FDAPT, fdapt)):
        for seed, score in enumerate(scores):
            _ner_run(tmp_path, model, seed, score)
    runs = ner.load(tmp_path)
    assert {seed: run["epoch"] for seed, run in runs[ner.ORIGINAL].items()} == {0: 2, 1: 2, 2: 2}
    assert runs[ner.CENTRAL][1]["test"] == pytest.approx(0.64)
    assert runs[ner.CENTRAL][1]["last"] == pytest.approx(0.59)
    ner.verdicts(runs)
    printed = capsys.readouterr().out
    assert "| T0 the original model's F1 lies in (0.2, 0.8) | 0.520 (3 seeds) | holds |" in printed
    assert "| T3 centralized DAPT beats the original | +0.100 [+0.050, +0.150] (3 seeds) | holds |" in printed
    assert "| T3 FDAPT 2 clients iid beats the original | +0.100 " in printed
    assert printed.rstrip().endswith("equivalent (band ±0.015; 3 seeds) | holds |")

    for seeds in runs.values():  # an original model that cannot be fine-tuned here decides nothing
        for run in seeds.values():
            run["test"] -= 0.45
    ner.verdicts(runs)
    printed = capsys.readouterr().out
    assert "| 0.070 (3 seeds) | fails |" in printed
    assert printed.count("not measurable here (T0)") == 3


def test_fedbert_t2_divergence_rule_and_the_single_client_side(capsys) -> None:
    import fedbert_gpt2_v2 as v2

    def grid(**final_perplexity: list[float]) -> dict:
        return {getattr(v2, name): {seed: [{"test_perplexity": 1000.0}, {"test_perplexity": value}]
                                    for seed, value in enumerate(values)} for name, values in final_perplexity.items()}

    # the start is round 0's perplexity of the untrained run (1000); Centralized ends at 100 and 110
    runs = grid(START=[1000.0, 1000.0], CENTRAL=[100.0, 110.0], FEDAVG5=[1500.0, 1200.0])
    assert v2.fedavg5_diverges(runs)[1] == "holds"
    runs = grid(START=[1000.0, 1000.0], CENTRAL=[100.0, 110.0], FEDAVG5=[150.0, 219.0])
    assert v2.fedavg5_diverges(runs)[1] == "does not hold here"
    runs = grid(START=[1000.0, 1000.0], CENTRAL=[100.0, 110.0], FEDAVG5=[1500.0, 150.0])
    assert v2.fedavg5_diverges(runs)[1] == "neither (reported as is)"
    assert v2.fedavg5_diverges(grid(CENTRAL=[100.0]))[1] == "not run"

    # T4's second row wants Single - Head-Emd Avg below 0: a single client 20 perplexity better in each seed
    runs = grid(SINGLE=[180.0, 190.0, 200.0], HEADEMD=[200.0, 211.0, 219.0], EMDAVG=[200.0, 211.0, 219.0])
    assert v2.paired(runs, v2.SINGLE, v2.HEADEMD) == [-20.0, -21.0, -19.0]
    # at its best round a single client that overfits is scored by its lowest perplexity over the trained rounds
    overfit = {**runs, v2.SINGLE: {**runs[v2.SINGLE], 0: [*runs[v2.SINGLE][0], {"test_perplexity": 400.0}]}}
    assert v2.best_against(overfit, v2.SINGLE, v2.EMDAVG) == [-20.0, -21.0, -19.0]
    assert v2.paired(overfit, v2.SINGLE, v2.EMDAVG)[0] == 200.0
    v2.claims(runs)
    printed = capsys.readouterr().out
    assert "| T4 Single client better than Head-Emd Avg: Single - Head-Emd Avg below 0 | -20.0 [" in printed
    assert "(3 seeds) | holds |" in printed
    assert "| T3 EmdAvg ~ Head-Emd Avg | +0.0 [+0.0, +0.0] equivalent (band ±10.0; 3 seeds) | holds |" in printed


def _finetuned(run_dir: Path, seed: int, scores: dict[str, float]) -> None:
    """A finished pre-training run of a seeded grid with its downstream fine-tuning runs' final scores."""
    _write_run(run_dir, {"seed": seed})
    for name, score in scores.items():
        task, metric = ("regression", "pearson") if name == "stsb" else ("classification", "accuracy")
        folder = run_dir / "downstream" / name
        _write_run(folder, {"eval": {}}, [{"round": 0, f"test_{metric}": 0.1}, {"round": 2, f"test_{metric}": score}])
        (folder / "data.json").write_text(json.dumps({"task": task}))


def test_table6_seeds_all_come_from_runs_and_seed0_is_checked_against_the_md(tmp_path: Path) -> None:
    import fedbert_finetune_seeds as table6

    names = ["sst2", "mrpc", "rte", "stsb", "sst2-probe"]
    first, second = tmp_path / "seeds", tmp_path / "seeds-1"  # seed 1 in a grid of its own, run beside seed 0's
    for root, seed, shift in ((first, 0, 0.0), (second, 1, 0.01)):
        _finetuned(root / f"Centralized_seed={seed}", seed, dict(zip(names, [0.688 + shift, 0.689, 0.502,
                                                                                 0.199, 0.581], strict=True)))
        _finetuned(root / f"method=Head-Emd_Share_carry_seed={seed}", seed,
                   dict(zip(names, [0.702, 0.684, 0.502, 0.178, 0.555 - shift], strict=True)))
    _finetuned(first / "method=Head-Emd_Share_seed=0", 0, dict(zip(names, [0.7] * 5, strict=True)))
    scores = table6.all_scores([first, second])
    assert sorted(scores["Centralized"]) == [0, 1]
    assert scores["Centralized"][1]["sst2 accuracy"] == pytest.approx(0.698)
    assert scores["Head-Emd Share carry"][1]["sst2-probe accuracy"] == pytest.approx(0.545)
    assert set(scores["Head-Emd Share"]) == {0}  # 'Head-Emd Share' does not take the carry runs

    md = tmp_path / "fedbert.md"
    md.write_text("## Table 6: RoBERTa\n\n| method | perplexity | SST-2 | MRPC | RTE | STS-B | probe |\n|---|\n"
                  "| Centralized | 73.7 | 0.688 | 0.689 | 0.502 | 0.199 | **0.581** |\n"
                  "| Head-Emd Share carry | 84.3 | 0.702 | 0.684 | 0.503 | 0.178 | 0.555 |\n\nafter\n")
    assert table6.reproduction(scores, md) == ["Head-Emd Share carry RTE acc: Table 6 0.503, rerun 0.502"]


def test_table6_claims_are_paired_by_seed_and_judged_by_their_fixed_rules(capsys) -> None:
    import fedbert_finetune_seeds as columns
    import fedbert_tables as table6

    # 2026-11-24's finals: Head-Emd Avg - EmdAvg = -8.3 / -21.0 / -29.6, whose interval fedbert.md quotes
    finals = {"Head-Emd Avg": {0: 344.1, 1: 253.9, 2: 339.7}, "EmdAvg": {0: 352.4, 1: 274.9, 2: 369.3},
              "FedAvg": {0: 600.0, 1: 610.0, 2: 620.0}, "Parallel FedAvg": {0: 601.0, 1: 611.0, 2: 621.0},
              "Single client": {0: 700.0, 1: 710.0, 2: 720.0}, "Centralized": {0: 100.0, 1: 110.0}}
    assert table6.paired(finals, "Head-Emd Avg", "EmdAvg") == pytest.approx([-8.3, -21.0, -29.6])
    table6.claims(finals)
    printed = capsys.readouterr().out
    assert "| -19.6 [-46.3, +7.0] (3 seeds) | within noise |" in printed
    assert "(band ±3% of FedAvg's mean, ±18.3): Parallel FedAvg - FedAvg | +1.0 / +1.0 / +1.0 |" in printed
    assert "+1.0 [+1.0, +1.0] (3 seeds) | holds |" in printed
    # Single client's interval is 710 ± 24.8: above FedAvg's mean 610, not above a method whose mean is 700
    single = table6.SeedStats((700.0, 710.0, 720.0))
    assert table6.single_above(single, finals["FedAvg"]) == "holds"
    assert table6.single_above(single, {0: 690.0, 1: 710.0}) == "does not hold here"
    assert table6.single_above(single, None) == "not run"
    parallel_far = {**finals, "Parallel FedAvg": {0: 630.0, 1: 640.0, 2: 650.0}}
    table6.claims(parallel_far)
    assert "+30.0 [+30.0, +30.0] (3 seeds) | does not hold here |" in capsys.readouterr().out

    def probe(**by_method: list[float]) -> dict:
        return {getattr(columns, name, name): {seed: {columns.PROBE: v} for seed, v in enumerate(values)}
                for name, values in by_method.items()}

    clear = probe(CENTRAL=[0.57, 0.58, 0.575], START=[0.50, 0.51, 0.509], CARRY=[0.55, 0.565, 0.55])
    assert columns.centralized_best_on_probe(clear) == "holds"
    close = probe(CENTRAL=[0.57, 0.58, 0.575], START=[0.50, 0.51, 0.509], CARRY=[0.58, 0.56, 0.57])
    assert columns.centralized_best_on_probe(close) == "within noise"
    beaten = probe(CENTRAL=[0.57, 0.58, 0.575], START=[0.60, 0.61, 0.605])
    assert columns.centralized_best_on_probe(beaten) == "does not hold here"
    assert columns.centralized_best_on_probe(probe(START=[0.5, 0.5])) == "not run"
    assert columns.helps(clear) == ["Centralized SST-2 probe acc", "Head-Emd Share carry SST-2 probe acc"]
