"""The tables, verdicts and plot of recipes/results/robustness.md from finished runs of recipes/robustness.yaml
(any subset of its cells, aggregators and seeds, from one or several grid directories, or a folder above them).

    .venv/bin/python recipes/results/robustness_table.py /tmp/robust/runs --plot recipes/results/robustness.png

Prints markdown: final test accuracy per aggregator (rows) and cell (columns: attack x share, clean IID, clean
label skew), mean ± sample sd over seeds; the backdoor's attack success rate; each cell's change against clean
FedAvg and each defence's cost against FedAvg (same-seed differences with their 95% Student-t interval); what
the aggregator did to the attackers (Krum's drops, norm bounding's factors, the trimmed mean's cut share); one
verdict per pre-registered target (T1-T8 of the recipe's header); every run's numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import yaml
from scipy import stats

AGGS = ("mean", "median", "trimmed_mean", "norm_bound", "krum")
ROBUST = AGGS[1:]
CLEAN, SKEW = "clean iid", "clean skew"
SCALE, FLIP, BACKDOOR = "scale x10 30%", "label_flip 30%", "backdoor 30%"


def find_runs(roots: list[Path]) -> list[dict]:
    """One row per finished run (a directory with data.json, config.yaml and a final test accuracy)."""
    rows = []
    for root in roots:
        for data_path in sorted(root.rglob("data.json")):
            run = data_path.parent
            config = yaml.safe_load((run / "config.yaml").read_text())
            tags = config.get("tags") or {}
            if "cell" not in tags or "agg" not in tags:
                continue
            metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            scored = [m for m in metrics if m.get("test_accuracy") is not None]
            if not scored or scored[-1]["round"] != config["protocol"]["rounds"]:
                continue  # unfinished
            data = json.loads(data_path.read_text())
            rows.append({
                "cell": tags["cell"], "agg": tags["agg"], "seed": config["seed"], "dir": str(run),
                "start": scored[0]["test_accuracy"], "final": scored[-1]["test_accuracy"],
                "asr": scored[-1].get("attack_success_rate"), "asr_start": scored[0].get("attack_success_rate"),
                "attackers": data.get("attackers") or [], "rounds": [m for m in metrics if m["round"] > 0],
                "wall": sum(m.get("wall_s", 0.0) for m in metrics),
            })
    return rows


def t_interval(values: list[float]) -> tuple[float, float, float] | None:
    """Mean and its 95% Student-t interval; None from fewer than 2 values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def cell_text(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (1)"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f} ({len(values)})"


def diff_text(diffs: list[float]) -> str:
    if not diffs:
        return "-"
    ci = t_interval(diffs)
    if ci is None:
        return f"{diffs[0]:+.3f} (1 seed)"
    return f"{ci[0]:+.3f} [{ci[1]:+.3f}, {ci[2]:+.3f}] ({len(diffs)})"


class Runs:
    def __init__(self, rows: list[dict]) -> None:
        self.by = {(r["cell"], r["agg"], r["seed"]): r for r in rows}
        self.cells = [c for c in (CLEAN, SCALE, FLIP, BACKDOOR, SKEW) if any(k[0] == c for k in self.by)]
        self.cells += sorted({k[0] for k in self.by} - set(self.cells))
        self.aggs = [a for a in AGGS if any(k[1] == a for k in self.by)]

    def values(self, cell: str, agg: str, key: str = "final") -> list[float]:
        return [r[key] for (c, a, _), r in sorted(self.by.items()) if c == cell and a == agg and r[key] is not None]

    def paired(self, a: tuple[str, str], b: tuple[str, str], key_a: str = "final", key_b: str | None = None
               ) -> list[float]:
        """Same-seed differences a - b over the seeds both ran."""
        key_b = key_b or key_a
        seeds = sorted({s for (c, g, s) in self.by if (c, g) == a} & {s for (c, g, s) in self.by if (c, g) == b})
        return [self.by[(*a, s)][key_a] - self.by[(*b, s)][key_b] for s in seeds
                if self.by[(*a, s)][key_a] is not None and self.by[(*b, s)][key_b] is not None]


def accuracy_table(runs: Runs) -> str:
    lines = ["| aggregator | " + " | ".join(runs.cells) + " | backdoor ASR (start -> final) |",
             "|---|" + "---:|" * (len(runs.cells) + 1)]
    for agg in runs.aggs:
        asr = runs.values(BACKDOOR, agg, "asr")
        start = runs.values(BACKDOOR, agg, "asr_start")
        asr_text = f"{statistics.fmean(start):.3f} -> {cell_text(asr)}" if asr else "-"
        lines.append(f"| {agg} | " + " | ".join(cell_text(runs.values(c, agg)) for c in runs.cells)
                     + f" | {asr_text} |")
    return "\n".join(lines)


def effect_table(runs: Runs) -> str:
    """Each cell minus clean FedAvg, same seed: what the attack (or the skew) and the rule together cost."""
    cells = [c for c in runs.cells if c != CLEAN]
    if not cells:
        return "(no attacked or skewed cell finished)"
    lines = ["| aggregator | " + " | ".join(f"{c} - clean FedAvg" for c in cells) + " |",
             "|---|" + "---:|" * len(cells)]
    for agg in runs.aggs:
        lines.append(f"| {agg} | " + " | ".join(diff_text(runs.paired((c, agg), (CLEAN, "mean"))) for c in cells)
                     + " |")
    return "\n".join(lines)


def cost_table(runs: Runs) -> str:
    """Each robust rule minus FedAvg on clean data, IID and label skew, and the skew's extra cost."""
    lines = ["| aggregator | clean IID: rule - FedAvg | label skew: rule - FedAvg | skew minus IID difference |",
             "|---|---:|---:|---:|"]
    for agg in runs.aggs:
        if agg == "mean":
            continue
        iid = runs.paired((CLEAN, agg), (CLEAN, "mean"))
        skew = runs.paired((SKEW, agg), (SKEW, "mean"))
        seeds = sorted({s for (c, g, s) in runs.by if g == agg and c in (CLEAN, SKEW)})
        extra = [(runs.by[(SKEW, agg, s)]["final"] - runs.by[(SKEW, "mean", s)]["final"])
                 - (runs.by[(CLEAN, agg, s)]["final"] - runs.by[(CLEAN, "mean", s)]["final"])
                 for s in seeds if all(k in runs.by for k in ((SKEW, agg, s), (SKEW, "mean", s), (CLEAN, agg, s),
                                                              (CLEAN, "mean", s)))]
        lines.append(f"| {agg} | {diff_text(iid)} | {diff_text(skew)} | {diff_text(extra)} |")
    return "\n".join(lines)


def defence_table(runs: Runs) -> str:
    """What each rule did to the attackers and to the honest clients, averaged over rounds and seeds."""
    lines = ["| cell | aggregator | seeds | attackers' change norm / honest | Krum: attackers dropped (honest) | "
             "norm_bound: attackers' factor (honest) | trimmed: attackers' share cut (honest) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for cell in runs.cells:
        for agg in runs.aggs:
            rs = [r for (c, a, _), r in sorted(runs.by.items()) if c == cell and a == agg and r["attackers"]]
            if not rs:
                continue
            ratio, kd, hd, kf, hf, kt, ht = [], [], [], [], [], [], []
            for r in rs:
                bad = {str(c) for c in r["attackers"]}
                for m in r["rounds"]:
                    norms = m.get("update_norms") or {}
                    a = [v for k, v in norms.items() if k in bad]
                    h = [v for k, v in norms.items() if k not in bad]
                    if a and h:
                        ratio.append(statistics.fmean(a) / statistics.fmean(h))
                    defence = m.get("defence") or {}
                    if "dropped" in defence:
                        dropped = {str(c) for c in defence["dropped"]}
                        kd.append(len(dropped & bad) / len(bad))
                        hd.append(len(dropped - bad) / (len(norms) - len(bad)))
                    if "down_weighted" in defence:
                        factors = defence["down_weighted"]
                        kf.extend(factors.get(c, 1.0) for c in norms if c in bad)
                        hf.extend(factors.get(c, 1.0) for c in norms if c not in bad)
                    if "trimmed_share" in defence:
                        share = defence["trimmed_share"]
                        kt.extend(v for c, v in share.items() if c in bad)
                        ht.extend(v for c, v in share.items() if c not in bad)

            def pair(x: list[float], y: list[float]) -> str:
                return f"{statistics.fmean(x):.2f} ({statistics.fmean(y):.2f})" if x and y else "-"

            lines.append(f"| {cell} | {agg} | {len(rs)} | {statistics.fmean(ratio):.2f} | {pair(kd, hd)} | "
                         f"{pair(kf, hf)} | {pair(kt, ht)} |")
    return "\n".join(lines)


def judge(diffs: list[float], low: float = -math.inf, high: float = math.inf) -> str:
    """'holds' when the 95% interval of the mean lies inside [low, high], 'does not hold' when outside."""
    if not diffs:
        return "not measured"
    ci = t_interval(diffs)
    if ci is None:
        inside = low <= diffs[0] <= high
        return f"1 seed only: {diffs[0]:+.3f} is {'inside' if inside else 'outside'} the band (no interval)"
    mean, lo, hi = ci
    text = f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}], {len(diffs)} seeds"
    if low <= lo and hi <= high:
        return f"holds ({text})"
    if hi < low or lo > high:
        return f"does not hold ({text})"
    return f"within noise, undecided ({text})"


def verdicts(runs: Runs) -> str:
    out = []
    fedavg_scale = runs.values(SCALE, "mean")
    out.append(f"- **T1** FedAvg under scale x10 at 30% <= 0.60: {judge(fedavg_scale, -math.inf, 0.60)} "
               f"(the mean accuracy itself; clean FedAvg {cell_text(runs.values(CLEAN, 'mean'))})")
    for agg in ROBUST:
        out.append(f"- **T2** {agg} under scale x10 at 30% within 5 points of clean FedAvg (difference >= -0.05): "
                   f"{judge(runs.paired((SCALE, agg), (CLEAN, 'mean')), -0.05)}")
    out.append(f"- **T3** Krum tolerates f = 3 < n/2 - 1 scaled attackers at n = 10: its T2 line above, "
               f"{judge(runs.paired((SCALE, 'krum'), (CLEAN, 'mean')), -0.05)}; f = 4 at n = 10 is refused "
               "before the run (see robustness.md); past f: not measurable")
    out.append("- **T4** the median breaks at 50% attackers: not measurable (the design stops at 30%)")
    loss = runs.paired((CLEAN, "mean"), (FLIP, "mean"))
    out.append(f"- **T5a** FedAvg loses >= 5 points under label_flip 30%: {judge(loss, 0.05)}")
    for agg in ROBUST:
        seeds = sorted(s for (c, g, s) in runs.by if c == FLIP and g == agg
                       and (FLIP, "mean", s) in runs.by and (CLEAN, "mean", s) in runs.by)
        # recovery beyond half the loss: (rule - FedAvg under the attack) - loss / 2 < 0 holds
        excess = [(runs.by[(FLIP, agg, s)]["final"] - runs.by[(FLIP, "mean", s)]["final"])
                  - 0.5 * (runs.by[(CLEAN, "mean", s)]["final"] - runs.by[(FLIP, "mean", s)]["final"]) for s in seeds]
        if True:
            out.append(f"- **T5b** {agg} recovers no more than half of FedAvg's label-flip loss (recovery - loss/2 "
                       f"< 0): {judge(excess, -math.inf, 0.0)}")
    asr = runs.values(BACKDOOR, "mean", "asr")
    out.append(f"- **T6a** FedAvg's backdoor success rate >= 0.5: {judge(asr, 0.5)}")
    for agg in ROBUST:
        drop = runs.paired((BACKDOOR, "mean"), (BACKDOOR, agg), "asr")
        if agg != "krum":
            out.append(f"- **T6b** {agg} lowers the success rate by less than 0.1 (FedAvg ASR - rule ASR < 0.1): "
                       f"{judge(drop, -math.inf, 0.1)}")
    for agg in ROBUST:
        if True:
            out.append(f"- **T7** {agg} on clean IID data within 2 points of FedAvg: "
                       f"{judge(runs.paired((CLEAN, agg), (CLEAN, 'mean')), -0.02, 0.02)}")
    for agg in ("median", "trimmed_mean", "krum"):
        seeds = sorted(s for (c, g, s) in runs.by if c == SKEW and g == agg)
        extra = [(runs.by[(SKEW, agg, s)]["final"] - runs.by[(SKEW, "mean", s)]["final"])
                 - (runs.by[(CLEAN, agg, s)]["final"] - runs.by[(CLEAN, "mean", s)]["final"])
                 for s in seeds if all(k in runs.by for k in ((SKEW, "mean", s), (CLEAN, agg, s),
                                                              (CLEAN, "mean", s)))]
        if True:
            out.append(f"- **T8a** {agg} loses more against FedAvg under label skew than under IID (skew difference "
                       f"- IID difference < 0): {judge(extra, -math.inf, 0.0)}")
    for agg in ("median", "krum"):
        skew = runs.paired((SKEW, agg), (SKEW, "mean"))
        if True:
            out.append(f"- **T8b** {agg} >= 3 points below FedAvg under label skew: {judge(skew, -math.inf, -0.03)}")
    return "\n".join(out)


def per_run(runs: Runs) -> str:
    lines = ["| cell | aggregator | seed | attackers | start | final | ASR start -> final | wall s |",
             "|---|---|---:|---|---:|---:|---|---:|"]
    for (cell, agg, seed), r in sorted(runs.by.items(), key=lambda kv: (runs.cells.index(kv[0][0]),
                                                                         AGGS.index(kv[0][1]), kv[0][2])):
        asr = f"{r['asr_start']:.3f} -> {r['asr']:.3f}" if r["asr"] is not None else "-"
        lines.append(f"| {cell} | {agg} | {seed} | {r['attackers'] or '-'} | {r['start']:.4f} | {r['final']:.4f} | "
                     f"{asr} | {r['wall']:.0f} |")
    return "\n".join(lines)


def plot(runs: Runs, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [4, 1]})
    width = 0.8 / len(runs.aggs)
    for i, agg in enumerate(runs.aggs):
        xs, ys, errs = [], [], []
        for j, cell in enumerate(runs.cells):
            values = runs.values(cell, agg)
            if values:
                ci = t_interval(values)
                xs.append(j + (i - (len(runs.aggs) - 1) / 2) * width)
                ys.append(statistics.fmean(values))
                errs.append(ci[2] - ci[0] if ci else 0.0)
        ax.bar(xs, ys, width, yerr=errs, capsize=2, label=agg)
        asr = runs.values(BACKDOOR, agg, "asr")
        if asr:
            ci = t_interval(asr)
            bx.bar(i, statistics.fmean(asr), yerr=(ci[2] - ci[0]) if ci else 0.0, capsize=2, color=f"C{i}")
    ax.axhline(0.509, color="grey", linestyle=":", label="majority class")
    ax.set_xticks(range(len(runs.cells)), runs.cells)
    ax.set_ylim(0.4, 0.85)
    ax.set_ylabel("final test accuracy (mean, 95% t-interval)")
    ax.legend(fontsize=8, ncol=3)
    bx.set_xticks(range(len(runs.aggs)), runs.aggs, rotation=45)
    bx.set_ylim(0, 1)
    bx.set_title("backdoor 30%: attack success", fontsize=9)
    fig.suptitle("SST-2, MiniLM (block 6 + head), 10 clients, 3 rounds: aggregators under attack")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("roots", nargs="+", type=Path, help="grid directories or folders above them")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    rows = find_runs(args.roots)
    runs = Runs(rows)
    print(f"{len(rows)} finished runs; wall {sum(r['wall'] for r in rows) / 60:.1f} min (sum of rounds)\n")
    sections = [
        ("Final test accuracy (mean ± sd (seeds)); backdoor attack success rate", accuracy_table),
        ("Against clean FedAvg (same seed; mean [95% t-interval] (seeds))", effect_table),
        ("The cost of each defence on clean data, IID and label skew (alpha 0.5)", cost_table),
        ("What the aggregator did to the attackers (mean over rounds and seeds)", defence_table),
        ("Verdicts", verdicts),
    ]
    for title, table in sections:
        print(f"## {title}\n\n{table(runs)}\n")
    print(f"## Every run\n\n{per_run(runs)}")
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
