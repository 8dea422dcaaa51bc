"""The tables and plot of recipes/results/privacy.md from finished runs of recipes/privacy-audit.yaml (audited
with `fedlm audit`) and recipes/privacy-dp.yaml (any number of seeds, from one or several grid directories).

    .venv/bin/python recipes/results/privacy_tables.py --audit RUNS/privacy-audit [...] \
        --dp RUNS/privacy-dp [RUNS/privacy-dp-seeds ...] --plot recipes/results/privacy.png

Prints markdown: the activation-inversion table, the update-leakage table, and utility against epsilon
(accuracy at round 0 and after the last round, mean +- sample sd over seeds, and the epsilon the run reported).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib
import yaml

from fedlm.run.recorder import read_metrics

matplotlib.use("Agg")
import matplotlib.pyplot as plt

KINDS = ("sample", "client")


def run_dirs(roots: list[Path]) -> list[Path]:
    """Every run directory (one holding metrics.jsonl) directly under the given grid directories."""
    return sorted(p for root in roots for p in root.iterdir() if (p / "metrics.jsonl").is_file())


def audit_tables(roots: list[Path]) -> str:
    """One row per audited run: inversion (untrained / trained bottom) and update leakage."""
    inv = ["| run | cut | attacker knows the trained bottom | client bottom | token accuracy | chance | BLEU-4 |",
           "|---|---|---|---|---:|---:|---:|"]
    leak = ["| run | codec | embeddings sent | recovered rows (mean) | true tokens (mean) | "
            "precision | recall |", "|---|---|---|---:|---:|---:|---:|"]
    exposure = ["| run | protocol | parameter tensors received | boundary messages (forward keys) | exposure checks |",
                "|---|---|---:|---|---|"]
    for run in run_dirs(roots):
        path = run / "audit.json"
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        label = yaml.safe_load((run / "config.yaml").read_text())["tags"].get("target", run.name)
        a = result.get("activation_inversion")
        if a is not None:
            for name in ("untrained", "trained"):
                row = a[name]
                inv.append(f"| {label} | ({a['cut'][0]}, {a['cut'][1]}) | {a['attacker_knows_trained_bottom']} | "
                           f"{name} | {row['token_accuracy']:.3f} | {row['chance_accuracy']:.3f} | "
                           f"{row['bleu4']:.1f} |")
        received = result["exposure"]["received"]
        forward = ", ".join(sorted(received.get("boundary", {}).get("forward", {})))
        boundary = f"{received['boundary_messages']} ({forward})" if "boundary_messages" in received else "none"
        violations = result["exposure"]["violations"]
        exposure.append(f"| {label} | {result['protocol']} | {len(received['uploads'])} | {boundary} | "
                        f"{'pass' if not violations else 'FAIL: ' + '; '.join(violations)} |")
        u = result["update_leakage"]
        scored = [r for r in u["clients"] if r.get("sent_embedding")]
        if scored:
            rec = statistics.mean(r["recovered"] for r in scored)
            true = statistics.mean(r["true"] for r in scored)
            leak.append(f"| {label} | {u['codec']} | yes | {rec:.0f} | {true:.0f} | {u['precision']:.3f} | "
                        f"{u['recall']:.3f} |")
        else:
            leak.append(f"| {label} | {u['codec']} | no | | | | |")
    return "\n".join([*inv, "", *leak, "", *exposure])


def dp_results(roots: list[Path]) -> dict[str, list[dict]]:
    """setting label -> one record per seed: kind, seed, round-0 and final accuracy, reported epsilon."""
    out: dict[str, list[dict]] = defaultdict(list)
    for run in run_dirs(roots):
        config = yaml.safe_load((run / "config.yaml").read_text())
        scored = [m for m in read_metrics(run) if m.get("test_accuracy") is not None]
        if not scored or scored[-1]["round"] != config["protocol"]["rounds"]:
            continue  # unfinished
        last = read_metrics(run)[-1]
        eps = last.get("dp_epsilon")
        out[config["tags"]["dp"]].append({
            "kind": config["privacy"]["kind"], "seed": config["seed"], "start": scored[0]["test_accuracy"],
            "final": scored[-1]["test_accuracy"], "z": config["privacy"]["noise_multiplier"],
            "epsilon": math.inf if config["privacy"]["kind"] == "none" or eps is None else eps})
    return out


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def dp_table(results: dict[str, list[dict]]) -> str:
    lines = ["| setting | z | epsilon reported (delta 1e-5) | seeds | accuracy round 0 | final accuracy | per seed |",
             "|---|---:|---:|---:|---:|---:|---|"]
    order = sorted(results, key=lambda k: (results[k][0]["kind"] != "none", results[k][0]["kind"],
                                           -results[k][0]["epsilon"]))
    for label in order:
        rows = sorted(results[label], key=lambda r: r["seed"])
        eps = rows[0]["epsilon"]
        z = "-" if rows[0]["kind"] == "none" else f"{rows[0]['z']:.3f}"
        lines.append(f"| {label} | {z} | {'inf' if math.isinf(eps) else f'{eps:.2f}'} | {len(rows)} | "
                     f"{mean_sd([r['start'] for r in rows])} | {mean_sd([r['final'] for r in rows])} | "
                     + ", ".join(f"s{r['seed']}: {r['final']:.3f}" for r in rows) + " |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    """Final accuracy against reported epsilon (log axis), no DP drawn at the right edge, round 0 as a line."""
    fig, ax = plt.subplots(figsize=(5.2, 3.4), dpi=110)
    inf_x = 30.0
    none = [r for rows in results.values() for r in rows if r["kind"] == "none"]
    starts = [r["start"] for rows in results.values() for r in rows]
    for kind, marker in zip(KINDS, "os", strict=True):
        points = sorted((rows[0]["epsilon"], [r["final"] for r in rows]) for rows in results.values()
                        if rows[0]["kind"] == kind and rows[0]["z"] > 0)
        if not points:
            continue
        xs = [e for e, _ in points]
        ys = [statistics.mean(v) for _, v in points]
        err = [statistics.stdev(v) if len(v) > 1 else 0.0 for _, v in points]
        ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, label=f"{kind} level (DP-SGD)" if kind == "sample"
                    else f"{kind} level (DP-FedAvg)")
    if none:
        finals = [r["final"] for r in none]
        ax.errorbar([inf_x], [statistics.mean(finals)], yerr=[statistics.stdev(finals) if len(finals) > 1 else 0.0],
                    marker="*", ms=10, color="k", capsize=3, ls="none", label=f"no DP ({len(finals)} seeds)")
    clip_only = [r["final"] for rows in results.values() for r in rows if r["kind"] == "sample" and r["z"] == 0]
    if clip_only:
        ax.plot([inf_x] * len(clip_only), clip_only, "k^", label="DP-SGD clipping only (z = 0)")
    if starts:
        ax.axhline(statistics.mean(starts), color="grey", ls="--", lw=1, label="round 0 (no training)")
    ax.set_xscale("log")
    ax.set_xticks([1, 3, 8, inf_x])
    ax.set_xticklabels(["1", "3", "8", "no DP"])
    ax.set_xlabel("epsilon at delta = 1e-5 (reported by the run)")
    ax.set_ylabel("SST-2 validation accuracy")
    ax.set_title("MiniLM, 5 clients x 100 sentences, 3 rounds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--audit", type=Path, nargs="*", default=[])
    parser.add_argument("--dp", type=Path, nargs="*", default=[])
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.audit:
        print(audit_tables(args.audit), end="\n\n")
    if args.dp:
        results = dp_results(args.dp)
        print(dp_table(results))
        if args.plot:
            plot(results, args.plot)


if __name__ == "__main__":
    main()
