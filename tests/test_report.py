"""Tables and plots from metrics records."""

from fedlm.run.report import pivot_table, plot_run, summarize

RECORDS = [
    {"round": 0, "train_loss": None, "test_accuracy": 0.25, "bytes_up": 0, "bytes_down": 0, "wall_s": 0.5},
    {"round": 1, "train_loss": 1.0, "test_accuracy": 0.5, "bytes_up": 10, "bytes_down": 20, "wall_s": 1.0},
    {"round": 2, "train_loss": 0.8, "test_accuracy": 0.4, "bytes_up": 10, "bytes_down": 20, "wall_s": 1.0},
]


def test_summary_separates_start_final_and_best():
    s = summarize(RECORDS, "accuracy", "max")
    assert (s["start accuracy"], s["final accuracy"], s["best accuracy"]) == (0.25, 0.4, 0.5)
    assert s["MB up"] == 20 / 1e6 and s["rounds"] == 2


def test_pivot_fills_baseline_column_for_every_row():
    s = summarize(RECORDS, "accuracy", "max")
    cells = [("iid", "fedavg", s, "accuracy"), ("alpha=1", "fedavg", s, "accuracy"),
             ("iid", "centralized", s, "accuracy")]
    text = pivot_table(cells)
    rows = [ln for ln in text.splitlines() if ln.startswith("| alpha=1")]
    assert rows == ["| alpha=1 | 0.2500 | 0.4000 (0.5000) | 0.4000 (0.5000) |"]


def test_pivot_reports_bytes_and_rounds_to_reach_the_target():
    records = [{"round": 0, "test_accuracy": 0.2, "bytes_up": 0, "bytes_down": 0},
               {"round": 1, "test_accuracy": 0.6, "bytes_up": 1e6, "bytes_down": 2e6},
               {"round": 2, "test_accuracy": 0.8, "bytes_up": 1e6, "bytes_down": 2e6}]
    fast = summarize(records, "accuracy", "max", goal=0.5)
    slow = summarize(records, "accuracy", "max", goal=0.7)
    never = summarize(records, "accuracy", "max", goal=0.9)
    assert (fast["round to target"], fast["MB to target"]) == (1, 3.0)
    assert (slow["round to target"], slow["MB to target"]) == (2, 6.0)
    assert never["MB to target"] is None
    text = pivot_table([("a", "x", fast, "accuracy"), ("a", "y", slow, "accuracy")])
    assert "| a | 0.5000 | 3.0000 (1) | 6.0000 (2) |" in text


def test_learning_curve_png_is_written(tmp_path):
    (path,) = plot_run(RECORDS, "accuracy", tmp_path, "t")
    assert path.is_file() and path.stat().st_size > 1000


def test_spread_is_the_clients_local_std_when_the_headline_is_one_global_model():
    records = [dict(r, local_accuracy_mean=0.5, local_accuracy_std=0.125) for r in RECORDS]
    assert summarize(records, "accuracy", "max")["spread (std over clients)"] == 0.125
    personalized = [{"round": 1, "test_accuracy_mean": 0.6, "test_accuracy_std": 0.25, "local_accuracy_std": 0.1}]
    assert summarize(personalized, "accuracy", "max")["spread (std over clients)"] == 0.25
    assert summarize(RECORDS, "accuracy", "max")["spread (std over clients)"] is None


def test_summary_names_the_clients_a_defence_flagged_and_a_backdoors_success():
    records = [RECORDS[0],
               {**RECORDS[1], "defence": {"dropped": [3, 1]}, "attack_success_rate": 0.2},
               {**RECORDS[2], "defence": {"bound": 1.0, "down_weighted": {"3": 0.1}}, "attack_success_rate": 0.1}]
    s = summarize(records, "accuracy", "max")
    assert s["flagged by the aggregator"] == "3 (2/2 rounds), 1 (1/2 rounds)"
    assert (s["final attack success"], s["max attack success"]) == (0.1, 0.2)
    assert "flagged by the aggregator" not in summarize(RECORDS, "accuracy", "max")
