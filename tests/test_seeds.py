"""Seeds: expansion, mean ± sd and 95% t-intervals, 'within noise' verdicts, and seeded grids run and resumed."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest

from fedlm.cli.commands import report_runs
from fedlm.config import expand_runs, validate
from fedlm.errors import UserError
from fedlm.run.grid import resume_run, run_config, warn_without_isolated
from fedlm.run.recorder import read_metrics
from fedlm.run.report import pivot_table, plot_grid, seed_band
from fedlm.run.seeds import (
    SeededRow,
    SeedStats,
    aggregate,
    equivalence,
    merge_cells,
    overlap,
    paired_difference,
    seeded_table,
    setting_key,
    setting_label,
    verdict,
)
from tests.conftest import tiny_config

T_975_2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (printed tables: 4.303)


def test_mean_sd_and_interval_of_three_seeds_by_hand():
    stats = SeedStats((0.7, 0.8, 0.9))
    assert stats.n == 3 and math.isclose(stats.mean, 0.8) and math.isclose(stats.sd, 0.1)
    half = T_975_2 * 0.1 / math.sqrt(3)  # 0.24841...
    low, high = stats.interval
    assert math.isclose(low, 0.8 - half) and math.isclose(high, 0.8 + half)
    assert str(stats) == "0.8000 ± 0.1000"


def test_one_seed_has_no_interval_and_a_missing_seed_is_counted():
    assert SeedStats((0.5,)).interval is None and str(SeedStats((0.5,))) == "0.5000"
    assert str(SeedStats((2.0, 4.0), missing=1)) == "3.0000 ± 1.4142 (2/3)"


def test_fixed_digits_text_for_result_tables():
    # 0.8 +- 4.3027 * 0.1 / sqrt(3) = [0.552, 1.048]
    assert SeedStats((0.7, 0.8, 0.9)).fixed(interval=True) == "0.800 ± 0.100 (3 seeds) [0.552, 1.048]"
    assert SeedStats((184.25, 183.8, 185.2)).fixed(1) == "184.4 ± 0.7 (3 seeds)"
    assert SeedStats((0.5,)).fixed(interval=True) == "0.500 (1 seed)" and SeedStats(()).fixed() == "-"


# half-width of three seeds with sd 0.02: 4.3027 * 0.02 / sqrt(3) = 0.04968
@pytest.mark.parametrize(("a", "b", "overlaps"), [
    ((0.70, 0.72, 0.74), (0.78, 0.80, 0.82), True),    # [0.670, 0.770] and [0.750, 0.850]
    ((0.70, 0.72, 0.74), (0.80, 0.82, 0.84), False),   # [0.670, 0.770] and [0.770, 0.870]: a gap of 0.0006
    ((0.70, 0.72, 0.74), (0.90, 0.92, 0.94), False),   # [0.670, 0.770] and [0.850, 0.950]
    ((0.70, 0.72, 0.74), (0.72, 0.72, 0.72), True),    # a point inside the other interval
    ((0.50, 0.50), (0.50, 0.50), True),                # no spread, equal means
    ((0.50, 0.50), (0.60, 0.60), False),               # no spread, different means
])
def test_within_noise_exactly_when_the_intervals_overlap(a, b, overlaps):
    sa, sb = SeedStats(a), SeedStats(b)
    (la, ha), (lb, hb) = sa.interval, sb.interval
    assert overlap(sa, sb) is overlaps is (la <= hb and lb <= ha)
    line = verdict("x", sa, "y", sb, "max")
    assert ("within noise" in line) is overlaps
    if not overlaps:
        assert ("better" if sa.mean > sb.mean else "worse") in line
        assert ("better" if sa.mean < sb.mean else "worse") in verdict("x", sa, "y", sb, "min")


def test_paired_difference_by_hand():
    # diffs 0.02, 0.04, 0.06: mean 0.04, sd 0.02, half-width 4.3027 * 0.02 / sqrt(3) = 0.0497
    assert paired_difference([0.02, 0.04, 0.06]) == "+0.040 [-0.010, +0.090] within noise (3 seeds)"
    higher = paired_difference([0.10, 0.12, 0.14], words=("higher", "lower"))
    assert higher == "+0.120 [+0.070, +0.170] higher (3 seeds)"
    assert paired_difference([-10.0, -12.0, -14.0], digits=1) == "-12.0 [-17.0, -7.0] worse (3 seeds)"
    assert paired_difference([0.5]) == "+0.500 (1 seed)" and paired_difference([]) == "-"


# three seeds: half-width = t(0.975, 2) * sd / sqrt(3) = 4.302653 * sd / 1.732051 = 2.484138 * sd
@pytest.mark.parametrize(("diffs", "band", "verdict_", "low", "high"), [
    # mean 0, sd 0.02, half 0.049683: [-0.049683, +0.049683]
    ((-0.02, 0.0, 0.02), 0.0497, "equivalent", -0.049683, 0.049683),      # just inside the band
    ((-0.02, 0.0, 0.02), 0.0496, "within noise", -0.049683, 0.049683),    # just outside it, and covers 0
    # mean 0.04, sd 0.02: [-0.009683, +0.089683]: no difference found, and none ruled out either
    ((0.02, 0.04, 0.06), 0.05, "within noise", -0.009683, 0.089683),
    # mean 0.12, sd 0.02: [+0.070317, +0.169683]
    ((0.10, 0.12, 0.14), 0.05, "differs", 0.070317, 0.169683),
    ((0.10, 0.12, 0.14), 0.2, "equivalent", 0.070317, 0.169683),          # a real difference, smaller than the band
    # mean -0.006667, sd 0.005774, half 0.014342: [-0.021009, +0.007676]
    ((-0.01, 0.0, -0.01), 0.03, "equivalent", -0.021009, 0.007676),
    # no spread: the interval is the point 0.25; a bound on the band's edge is not inside it
    ((0.25, 0.25), 0.25, "differs", 0.25, 0.25),
    ((0.25, 0.25), 0.2501, "equivalent", 0.25, 0.25),
    # two seeds: t(0.975, 1) = 12.706205, mean 0.1, sd 0.141421, half 1.270620: [-1.170620, +1.370620]
    ((0.0, 0.2), 1.0, "within noise", -1.170620, 1.370620),
])
def test_equivalence_by_two_one_sided_tests_on_hand_computed_intervals(diffs, band, verdict_, low, high):
    found = equivalence(diffs, band)
    assert found.verdict == verdict_ and found.n == len(diffs)
    assert found.interval == pytest.approx((low, high), abs=1e-6)


def test_equivalence_is_not_measurable_below_two_paired_seeds_or_without_a_band():
    assert math.isclose(T_975_2 / math.sqrt(3), 2.484138, abs_tol=1e-6)  # the factor the cases above use
    one = equivalence([0.01], 0.05)
    assert (one.verdict, one.interval, one.text()) == ("not measurable", None, "+0.0100 not measurable (1 paired seed)")
    assert equivalence([], 0.05).text() == "not measurable (0 paired seeds)"
    assert equivalence([0.01, math.nan], 0.05).verdict == "not measurable"  # a seed without a score does not pair
    unfixed = equivalence([0.0, 0.01, 0.02], None)
    assert unfixed.verdict == "not measurable" and "no equivalence band fixed" in unfixed.text()
    text = equivalence([-0.01, 0.0, -0.01], 0.03).text()
    assert text == "-0.0067 [-0.0210, +0.0077] equivalent (band ±0.0300; 3 seeds)"


def test_table_with_a_band_judges_same_seed_differences_from_the_groups_best():
    finals = {"a": (0.70, 0.72, 0.74), "b": (0.79, 0.82, 0.83), "c": (0.80, 0.82, 0.84)}
    runs = [SeededRow(name, "sst2", {"run": f"{name},seed={i}", **summary(v)})
            for name, values in finals.items() for i, v in reversed(list(enumerate(values)))]  # paired by seed
    runs.append(SeededRow("d", "sst2", {"run": "d,seed=0", **summary(0.5)}))
    text = seeded_table(runs, "accuracy", "max", band=0.03)
    assert "- [sst2] b vs c: within noise" in text  # overlapping intervals: today's difference test
    lines = text.split("Equivalence within ±0.03")[1].split("Every seed")[0].splitlines()
    assert [ln for ln in lines if ln.startswith("- ")] == [
        "- [sst2] a - c: -0.1000 [-0.1000, -0.1000] differs (band ±0.0300; 3 seeds)",
        "- [sst2] b - c: -0.0067 [-0.0210, +0.0077] equivalent (band ±0.0300; 3 seeds)",  # b - c: -0.01, 0, -0.01
        "- [sst2] d - c: -0.3000 not measurable (1 paired seed)",
    ]
    narrow = seeded_table(runs, "accuracy", "max", band=0.01)
    assert "- [sst2] b - c: -0.0067 [-0.0210, +0.0077] within noise (band ±0.0100; 3 seeds)" in narrow
    assert "Equivalence" not in seeded_table(runs, "accuracy", "max")


def test_one_seed_is_never_within_noise():
    line = verdict("x", SeedStats((0.7,)), "y", SeedStats((0.7, 0.8)), "max")
    assert "within noise" not in line and "cannot tell" in line


def summary(final: float, prior: float | None = None) -> dict:
    row = {"rounds": 2, "final accuracy": final, "best accuracy": final + 0.01}
    return row | ({"label prior accuracy (local)": prior} if prior is not None else {})


def test_table_shows_mean_sd_seeds_and_a_verdict_per_group():
    finals = {"a": (0.70, 0.72, 0.74), "b": (0.80, 0.82, 0.84), "c": (0.90, 0.92, 0.94)}
    runs = [SeededRow(name, "sst2", {"run": f"{name},seed={i}", **summary(v, 0.9)})
            for name, values in finals.items() for i, v in enumerate(values)]
    text = seeded_table(runs, "accuracy", "max")
    assert "| c | 3 | 2 | 0.9200 ± 0.0200 |" in text
    verdicts = [ln for ln in text.splitlines() if ln.startswith("- ")]
    assert verdicts == [
        "- [sst2] a vs c: worse (95% intervals [0.6703, 0.7697] vs [0.8703, 0.9697] are disjoint)",
        "- [sst2] b vs c: worse (95% intervals [0.7703, 0.8697] vs [0.8703, 0.9697] are disjoint)",
        "- [sst2] c vs the label prior: within noise (95% intervals [0.8703, 0.9697] vs [0.9000, 0.9000] overlap)",
    ]
    assert "| a,seed=2 |" in text  # every seed's own row follows


def test_single_seed_tables_say_no_verdict_can_be_drawn():
    text = seeded_table([SeededRow("a", "", {"run": "a", **summary(0.7)}),
                         SeededRow("b", "", {"run": "b", **summary(0.8)})], "accuracy", "max")
    assert "within noise" not in text and "no verdicts" in text


def test_aggregate_keeps_fixed_columns_and_counts_seeds_that_missed_the_target():
    row = aggregate("a", [{"rounds": 2, "target": 0.8, "round to target": 1},
                          {"rounds": 2, "target": 0.8, "round to target": None}])
    assert (row["seeds"], row["rounds"], row["target"]) == (2, 2, 0.8)
    assert str(row["round to target"]) == "1.0000 (1/2)"


def test_pivot_cells_of_one_setting_are_merged_over_seeds():
    cells = [("sst2", "fedavg", summary(v), "accuracy") for v in (0.7, 0.8, 0.9)]
    text = pivot_table(merge_cells(cells, ["k"] * 3))
    assert "| sst2 | - | 0.8000 ± 0.1000 (0.8100 ± 0.1000) |" in text


def test_setting_label_drops_the_seed_from_labels_and_directory_names():
    assert setting_label("method=c=2,seed=1") == setting_label("method=c=2_seed=1") == "method=c=2"
    assert setting_label("seed=3") == "" and setting_label("method=reseed=3x") == "method=reseed=3x"


def base() -> dict:
    return {"data": {"source": "x"}, "model": {"preset": "tiny"}}


def test_seeds_expand_every_setting_seed_by_seed():
    cfg = validate(base() | {"seeds": [0, 1], "grid": {
        "dataset": [{"label": "a", "data.source": "a"}, {"label": "b", "data.source": "b"}],
        "protocol.kind": ["fedavg", "isolated"]}, "baselines": [{"label": "central", "protocol.kind": "centralized"}]})
    runs = expand_runs(cfg)
    assert [r.label for r in runs[:5]] == ["dataset=a,protocol=fedavg,seed=0", "dataset=a,protocol=isolated,seed=0",
                                           "dataset=b,protocol=fedavg,seed=0", "dataset=b,protocol=isolated,seed=0",
                                           "central,seed=0"]
    assert len(runs) == 10 and [r.config.seed for r in runs] == [0] * 5 + [1] * 5
    assert runs[6].setting == "dataset=a,protocol=isolated" and runs[6].group == "dataset=a"
    assert runs[9].group is None and all(not r.config.seeds for r in runs)
    as_axis = validate(base() | {"grid": {"seed": [0, 1], "protocol.kind": ["fedavg", "isolated"]}})
    assert [(r.label, r.config.seed) for r in expand_runs(as_axis)] == [
        (r.label, r.config.seed) for r in expand_runs(validate(base() | {
            "seeds": [0, 1], "grid": {"protocol.kind": ["fedavg", "isolated"]}}))]
    alone = expand_runs(validate(base() | {"seeds": [5, 6]}))
    assert [(r.label, r.setting, r.config.seed) for r in alone] == [("seed=5", "", 5), ("seed=6", "", 6)]


@pytest.mark.parametrize(("raw", "message"), [
    ({"seeds": [1, 1]}, "seeds = [1, 1] repeats a seed"),
    ({"seeds": [1], "grid": {"seed": [2]}}, "seeds and grid.seed both set the seeds"),
    ({"grid": {"seed": [1, "x"]}}, "grid.seed = [1, 'x']: give distinct integer seeds"),
])
def test_bad_seeds_are_one_line(raw, message):
    with pytest.raises(UserError) as err:
        expand_runs(validate(base() | raw))
    assert str(err.value).startswith(f"config error: {message}") and "\n" not in str(err.value)


def trained(run_dir) -> list[dict]:
    """What a run computed, without its timings."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in read_metrics(run_dir)]


def test_seeds_give_different_runs_the_same_seed_the_same_run_and_resume_per_seed(tmp_path, tiny_csv, one_thread):
    raw = tiny_config(tmp_path, tiny_csv, rounds=1) | {"seeds": [3, 4]}
    raw["data"] |= {"max_train_examples": 48, "max_test_examples": 16}
    raw["eval"] |= {"equivalence_band": 0.05}  # judged by it, not trained differently: seeds 3 of both runs agree
    root = run_config(validate(raw), tiny_csv)
    first, second = root / "seed=3", root / "seed=4"
    assert trained(first) != trained(second)
    again = run_config(validate(raw | {"seeds": [3], "output_dir": str(tmp_path / "again")}), tiny_csv)
    assert trained(again / "seed=3") == trained(first)
    table = (root / "comparison.md").read_text()
    assert "| tiny | 2 |" in table and " ± " in table and (root / "comparison.png").stat().st_size > 1000
    assert "Equivalence within ±0.05 " in table  # the grid's band
    (root / "comparison.png").unlink()
    reported = report_runs([root])  # fedlm report groups the grid's runs by config, seed aside
    assert reported.splitlines()[4].startswith("| tiny | 2 |") and (root / "comparison.png").is_file()
    assert "Equivalence within ±0.05 " in reported and "Equivalence within ±0.5 " in report_runs([root], band=0.5)
    with pytest.raises(UserError, match="equivalence-band"):
        report_runs([root], band=0.0)
    shutil.rmtree(second / "model")  # seed 4 interrupted after its last round; seed 3 finished
    before = (first / "metrics.jsonl").stat().st_mtime_ns
    resume_run(root, tiny_csv)
    assert (first / "metrics.jsonl").stat().st_mtime_ns == before and (second / "model").is_dir()
    assert json.loads((second / "metrics.jsonl").read_text().splitlines()[-1])["round"] == 1


def test_a_personalised_grid_without_isolated_training_warns(caplog):
    def grid(*methods: dict) -> list:
        return expand_runs(validate(base() | {"grid": {"method": list(methods)}}))

    c2 = {"label": "c=2", "sharing.critical_layer": 2}
    with caplog.at_level(logging.WARNING, logger="fedlm"):
        warn_without_isolated("g", grid({"label": "fedavg"}, c2))
        assert "without isolated training" in caplog.text
        caplog.clear()
        warn_without_isolated("g", grid(c2, {"label": "isolated", "protocol.kind": "isolated"}))
        warn_without_isolated("g", grid(c2, {"label": "c=0", "sharing.critical_layer": 0}))
        warn_without_isolated("g", grid({"label": "fedavg"}, {"label": "fedprox", "protocol.kind": "fedprox"}))
        assert not caplog.text


def test_the_plot_band_is_the_mean_and_its_interval_per_round(tmp_path):
    one = [{"round": 0, "test_accuracy": 0.5}, {"round": 1, "test_accuracy": 0.5}]
    two = [{"round": 0, "test_accuracy": 0.5}, {"round": 1, "test_accuracy": 0.7}]
    rounds, mean, low, high = seed_band([one, two], "test_accuracy")
    half = 12.706204736174707 * math.sqrt(0.02) / math.sqrt(2)  # t(0.975, 1) * sd / sqrt(n)
    assert rounds == [0, 1] and mean == pytest.approx([0.5, 0.6])
    assert low == pytest.approx([0.5, 0.6 - half]) and high == pytest.approx([0.5, 0.6 + half])
    path = plot_grid([("a", [one, two]), ("b", [one])], "accuracy", tmp_path / "c.png", "t")
    assert path.stat().st_size > 1000


def test_setting_key_reads_a_missing_key_as_its_default(tmp_path):
    """A config.yaml written before train.lr_schedule existed is the same setting as one that spells out the
    default, and a different setting from one that changes it."""
    config = validate(tiny_config(tmp_path, tmp_path)).model_dump(mode="json")
    older = json.loads(json.dumps(config))
    del older["train"]["lr_schedule"]
    other = json.loads(json.dumps(config))
    other["train"]["lr_schedule"] = "cosine"
    assert setting_key({**older, "seed": 1}) == setting_key({**config, "seed": 2})
    assert setting_key(other) != setting_key(config)
    banded = json.loads(json.dumps(config))
    banded["eval"]["equivalence_band"] = 0.01  # how the runs are judged, not what they compute
    assert setting_key(banded) == setting_key(config)
