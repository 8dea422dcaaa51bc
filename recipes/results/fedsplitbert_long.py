"""The verdicts of recipes/fedsplitbert-long.yaml (issue 36 item 3) from its finished runs, by the rules fixed in
the recipe's header before the runs.

    .venv/bin/python recipes/results/fedsplitbert_long.py runs/fedsplitbert-long [runs/fedsplitbert-long-baselines] \
        [--plot recipes/results/fedsplitbert-long.png]
    .venv/bin/python recipes/results/fedsplitbert_long.py runs/fedsplitbert-long-mrpc \
        --plot recipes/results/fedsplitbert-long-mrpc.png

Prints markdown: each method's final local-test accuracy (mean ± sd [95% t-interval] over seeds), the clients'
label prior and the start; every pre-registered comparison as a same-seed difference with its 95% t-interval and
the verdict its rule gives (16-bit as an equivalence, band 0.02, by two one-sided tests); whether c matters at
this length; MB to the run's pre-registered target (`eval.target`) per seed. One dataset of the grid at a time
(`--dataset` when the runs hold several). A comparison whose runs are missing prints "not run". ``--plot``: each
setting's local-test accuracy per round (every seed thin, the mean thick) beside the label prior.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import matplotlib
import yaml
from fedsplitbert_targets import ACC, PRIOR, load, stats

from fedlm.metrics import mean_interval
from fedlm.run.recorder import read_metrics
from fedlm.run.report import metric_series
from fedlm.run.seeds import Equivalence, equivalence

matplotlib.use("Agg")
import matplotlib.pyplot as plt

C0, C3, C6 = "c=0 (isolated)", "c=3", "c=6 (FedAvg)"
FEDPROX, FEDADAM, FP16 = "FedProx", "FedAdam", "c=3 fp16"
FP16_BAND = 0.02
OTHER_SIDE = {"above 0": "below 0", "below 0": "above 0"}


def differences(runs: dict, a: str, b: str | None) -> list[float]:
    """Same-seed final local accuracy of ``a`` minus ``b`` (None: minus the clients' label prior); ``runs`` is
    keyed by (method, seed)."""
    seeds = sorted(s for m, s in runs if m == a)
    out = []
    for seed in seeds:
        left, right = runs.get((a, seed)), runs.get((b, seed)) if b else None
        if left and (right or b is None):
            out.append(left[ACC] - (right[ACC] if b else left[PRIOR]))
    return out


def interval(diffs: list[float], digits: int = 3) -> tuple[str, str]:
    """'mean [low, high] (n seeds)' and the difference rule's word: above 0, below 0, covers 0, not measurable
    (one seed) or not run (no paired seed)."""
    if not diffs:
        return NOT_RUN, NOT_RUN
    if len(diffs) < 2:
        return f"{diffs[0]:+.{digits}f} (1 seed)", "not measurable"
    mean, _, half = mean_interval(diffs)
    word = "above 0" if mean - half > 0 else "below 0" if mean + half < 0 else "covers 0"
    return f"{mean:+.{digits}f} [{mean - half:+.{digits}f}, {mean + half:+.{digits}f}] ({len(diffs)} seeds)", word


FEW_SEEDS = "not measurable here (fewer than 2 seeds)"
NOT_RUN = "not run"


def verdict(word: str, precondition: bool = True, wanted: str = "above 0") -> str:
    """A one-sided claim's verdict from ``interval``'s word: holds when the interval lies on the ``wanted`` side of
    0, does not hold on the other side, within noise when it covers 0; fewer than 2 seeds cannot be judged, and a
    comparison with no paired seed is "not run" whatever its precondition."""
    if word == NOT_RUN:
        return NOT_RUN
    if not precondition:
        return "not measurable here (precondition failed)"
    return {wanted: "holds", OTHER_SIDE[wanted]: "does not hold here", "covers 0": "within noise",
            "not measurable": FEW_SEEDS}[word]


def equivalence_verdict(found: Equivalence) -> str:
    """An equivalence claim's verdict (two one-sided tests): holds only when the whole interval lies in the band;
    "not run" with no paired seed."""
    if found.n == 0:
        return NOT_RUN
    return {"equivalent": "holds", "differs": "does not hold here",
            "not measurable": "not measurable here"}.get(found.verdict, found.verdict)


def c_matters(runs: dict, one_example: float, precondition: bool) -> str:
    """The recipe's "c matters at this length" rule, both readings of "the three c differ" printed;
    ``one_example`` is one local-test example's share of the accuracy (1 / the clients' local-test examples). When
    the precondition failed, differences between models that do not beat the label prior place nothing."""
    seeds = sorted(s for m, s in runs if m == C3)
    pairwise = spread = 0
    for seed in seeds:
        values = [runs[m, seed][ACC] for m in (C0, C3, C6) if (m, seed) in runs]
        if len(values) < 3:
            continue
        pairwise += all(abs(x - y) > one_example for x, y in itertools.combinations(values, 2))
        spread += max(values) - min(values) > one_example
    intervals = [interval(differences(runs, C3, ref))[1] for ref in (C0, C6)]
    excluded = any(word in ("above 0", "below 0") for word in intervals)
    holds = excluded or pairwise >= 2
    word = "holds" if holds else "does not hold here (this length still cannot place c)"
    if not precondition:
        word = f"{word} by the rule's letter; not measurable here (precondition failed)"
    return (f"an interval excludes 0: {excluded}; seeds where every pair of c differs by more than one local-test "
            f"example: {pairwise} of {len(seeds)} (where the largest and smallest c differ so: {spread}) -> {word}")


def to_target(runs: dict, method: str) -> dict[int, float | None]:
    return {s: c.get("MB to target") for (m, s), c in runs.items() if m == method}


def local_test_examples(roots: list[Path], dataset: str) -> int:
    """The clients' local-test examples of one of ``dataset``'s runs (every seed draws the same sizes)."""
    for config_path in sorted(p for root in roots for p in root.glob("*/config.yaml")):
        if yaml.safe_load(config_path.read_text())["tags"]["dataset"] == dataset:
            return sum(json.loads((config_path.parent / "data.json").read_text())["client_sizes"]["test"])
    raise SystemExit(f"no run of {dataset} under {', '.join(map(str, roots))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", type=Path, nargs="+")
    parser.add_argument("--dataset", help="the grid's dataset label (default: the one the runs hold)")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    loaded = load(args.roots)
    datasets = sorted({d for d, _, _ in loaded})
    if args.dataset is None and len(datasets) != 1:
        raise SystemExit(f"finished runs of {datasets or 'no dataset'}: name one with --dataset")
    dataset = args.dataset or datasets[0]
    runs = {(m, s): c for (d, m, s), c in loaded.items() if d == dataset}
    if not runs:
        raise SystemExit(f"no finished run of {dataset!r}; finished: {datasets}")
    methods = list(dict.fromkeys(m for m, _ in runs))
    first = methods[0]
    target = runs[next(iter(runs))]["target"]
    seeds = sorted({s for _, s in runs})

    def column(method: str, key: str) -> list[float]:
        return [c[key] for (m, _), c in sorted(runs.items()) if m == method]

    print("| setting | final local accuracy | shared dev accuracy | MB per round |\n|---|---|---|---:|")
    print(f"| start (round 0) | {stats(column(first, 'start accuracy'))} | - | - |")
    print(f"| label prior | {stats(column(first, PRIOR))} | - | - |")
    for m in methods:
        print(f"| {m} | {stats(column(m, ACC))} | {stats(column(m, 'shared'))} | {column(m, 'MB/round')[0]:.0f} |")

    pre = {m: interval(differences(runs, m, None)) for m in (C6, C3)}
    precondition = all(word == "above 0" for _, word in pre.values())
    print("\n| pre-registered comparison (same seed) | difference [95% interval] | verdict |\n|---|---|---|")
    for m, (text, word) in pre.items():
        print(f"| precondition: {m} - label prior | {text} | {'met' if word == 'above 0' else 'not met'} |")
    for claim, a, b in (("Table III: c = 3 - c = 6 (FedSplitBERT beats FedAvg)", C3, C6),
                        ("Discussion: c = 3 - c = 0 (shared layers beat isolated training)", C3, C0),
                        ("FedAdam - FedAvg", FEDADAM, C6), ("FedProx - FedAvg", FEDPROX, C6),
                        ("Table III: c = 3 - FedProx", C3, FEDPROX), ("Table III: c = 3 - FedAdam", C3, FEDADAM)):
        text, word = interval(differences(runs, a, b))
        print(f"| {claim} | {text} | {verdict(word, precondition)} |")
    fp16 = differences(runs, FP16, C3)
    judged = equivalence(fp16, FP16_BAND)
    text, _ = interval(fp16)
    print(f"| 16-bit keeps accuracy: c = 3 fp16 - c = 3 (equivalence, band ±{FP16_BAND}) | {text} | "
          f"{equivalence_verdict(judged)} |")
    examples = local_test_examples(args.roots, dataset)
    matters = c_matters(runs, 1 / examples, precondition)
    print(f"\nc matters at this length (one local-test example = 1/{examples}): {matters}")

    print(f"\nTable VI: MB (up + down) at the first round reaching local accuracy {target:.2f}, per seed "
          "(- = not reached)\n")
    print("| setting | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---|" + "---:|" * len(seeds))
    for m in methods:
        cells = to_target(runs, m)
        print(f"| {m} | " + " | ".join("-" if cells.get(s) is None else f"{cells[s]:.0f}" for s in seeds) + " |")
    c3, c6 = to_target(runs, C3), to_target(runs, C6)
    both = [s for s in c6 if c6[s] is not None]
    fewer = all(c3.get(s) is not None and c3[s] < c6[s] for s in both)
    reached = sum(v is not None for v in c3.values()) >= sum(v is not None for v in c6.values())
    rule = ("holds" if fewer and reached else "does not hold here") if both else \
        "not measurable here (FedAvg never reached it)"
    print(f"\nTable VI rule (c = 3 needs fewer MB than FedAvg in every seed where FedAvg reaches {target:.2f}, and "
          f"reaches it in at least as many seeds): {rule}")
    if args.plot:
        plot(args.roots, dataset, statistics.mean(column(first, PRIOR)), args.plot)


def plot(roots: list[Path], dataset: str, prior: float, path: Path) -> None:
    """Local-test accuracy per round of ``dataset``'s finished runs, by setting: seeds thin, their mean thick."""
    curves: dict[str, list[tuple[list[int], list[float]]]] = {}
    for config_path in sorted(p for root in roots for p in root.glob("*/config.yaml")):
        tags = yaml.safe_load(config_path.read_text())["tags"]
        if tags["dataset"] != dataset:
            continue
        series = metric_series(read_metrics(config_path.parent), "local_accuracy_mean")
        curves.setdefault(tags["method"], []).append(series)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for color, (method, series) in zip(plt.cm.tab10.colors, curves.items(), strict=False):
        for rounds, values in series:
            ax.plot(rounds, values, color=color, lw=0.7, alpha=0.5)
        full = [values for rounds, values in series if len(values) == len(max((v for _, v in series), key=len))]
        rounds = max((r for r, _ in series), key=len)
        ax.plot(rounds, [sum(v) / len(v) for v in zip(*full, strict=True)], color=color, lw=2.2,
                label=f"{method} ({len(full)} seeds)")
    ax.axhline(prior, color="grey", ls="--", lw=1, label="label prior (mean)")
    ax.set_xlabel("round (3 local epochs each)")
    ax.set_ylabel("local-test accuracy (mean over clients)")
    ax.set_title(f"FedSplitBERT trained longer: {dataset}, label-skewed, MiniLM")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
