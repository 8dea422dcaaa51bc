"""The tables and plot of recipes/results/privacy.md from finished runs of recipes/privacy-audit.yaml (audited
with `fedlm audit`) and recipes/privacy-dp.yaml (any number of seeds, from one or several grid directories).

    .venv/bin/python recipes/results/privacy_tables.py --audit RUNS/privacy-audit [...] \
        --dp RUNS/privacy-dp [RUNS/privacy-dp-seeds ...] --plot recipes/results/privacy.png

Prints markdown: the activation-inversion table and its same-seed differences, what the audited runs learnt
(test accuracy), the update-leakage and exposure tables, and utility against epsilon
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
from fedlm.run.rundir import run_dirs
from fedlm.run.seeds import paired_difference

matplotlib.use("Agg")
import matplotlib.pyplot as plt

KINDS = ("sample", "client")
LONG = "split11-local-10rounds"  # cut (1, 1) after 10 rounds at the recipe's client lr, 1e-4
HOTTER = {"3e-4": f"{LONG}-lr3e-4", "1e-3": f"{LONG}-lr1e-3"}  # the same at larger client learning rates
PREFIXES = "split11-ptv2"  # cut (1, 1): public weights frozen, P-Tuning v2 prefixes trained at lr 2e-2


def audits(roots: list[Path]) -> dict[str, list[dict]]:
    """target label -> the audit.json of each seed's run (sorted by seed), with 'seed' added and 'accuracy': the
    run's test accuracy (round 0, after the last round)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for run in run_dirs(roots):
        path = run / "audit.json"
        if path.is_file():
            config = yaml.safe_load((run / "config.yaml").read_text())
            scored = [test_accuracy(m) for m in read_metrics(run) if test_accuracy(m) is not None]
            out[config["tags"].get("target", run.name)].append(
                {**json.loads(path.read_text()), "seed": config["seed"], "accuracy": (scored[0], scored[-1])})
    return {label: sorted(rows, key=lambda r: r["seed"]) for label, rows in sorted(out.items())}


def inversion_table(results: dict[str, list[dict]]) -> str:
    lines = ["| run | seeds | cut | attacker knows the trained bottom | client bottom | token accuracy | chance | "
             "BLEU-4 | per seed: accuracy / BLEU-4 |", "|---|---:|---|---|---|---:|---:|---:|---|"]
    for label, rows in results.items():
        rows = [r for r in rows if "activation_inversion" in r]
        if not rows:
            continue
        a = rows[0]["activation_inversion"]
        for name in ("untrained", "trained"):
            scores = [r["activation_inversion"][name] for r in rows]
            per_seed = ", ".join(f"s{r['seed']}: {x['token_accuracy']:.3f} / {x['bleu4']:.1f}"
                                 for r, x in zip(rows, scores, strict=True))
            lines.append(f"| {label} | {len(rows)} | ({a['cut'][0]}, {a['cut'][1]}) | "
                         f"{a['attacker_knows_trained_bottom']} | {name} | "
                         f"{mean_sd([x['token_accuracy'] for x in scores])} | "
                         f"{mean_sd([x['chance_accuracy'] for x in scores])} | "
                         f"{mean_sd([x['bleu4'] for x in scores], 1)} | {per_seed} |")
    return "\n".join(lines)


def inversion_differences(results: dict[str, list[dict]]) -> str:
    """Same-seed differences of token accuracy that the recipe's targets name."""
    def accuracy(label: str, name: str) -> dict[int, float]:
        return {r["seed"]: r["activation_inversion"][name]["token_accuracy"] for r in results.get(label, [])
                if "activation_inversion" in r}

    pairs = [("split11-local minus split00-average, untrained", accuracy("split11-local", "untrained"),
              accuracy("split00-average", "untrained")),
             ("split11-local minus split00-average, trained", accuracy("split11-local", "trained"),
              accuracy("split00-average", "trained")),
             ("split11-local, trained minus untrained", accuracy("split11-local", "trained"),
              accuracy("split11-local", "untrained")),
             ("split22-local minus split11-local, untrained", accuracy("split22-local", "untrained"),
              accuracy("split11-local", "untrained")),
             ("split22-local minus split11-local, trained", accuracy("split22-local", "trained"),
              accuracy("split11-local", "trained")),
             ("split11-local-10rounds, trained minus untrained", accuracy(LONG, "trained"),
              accuracy(LONG, "untrained")),
             *((f"split11-local-10rounds at lr {lr}, trained minus untrained", accuracy(label, "trained"),
                accuracy(label, "untrained")) for lr, label in HOTTER.items()),
             *((f"lr {lr} minus lr 1e-4 (10 rounds each), trained", accuracy(label, "trained"),
                accuracy(LONG, "trained")) for lr, label in HOTTER.items()),
             ("split11-ptv2 (prefixes only, lr 2e-2), trained minus untrained", accuracy(PREFIXES, "trained"),
              accuracy(PREFIXES, "untrained"))]
    lines = ["| token accuracy, same seed | difference [95% interval] |", "|---|---|"]
    for what, a, b in pairs:
        seeds = sorted(set(a) & set(b))
        if seeds:
            lines.append(f"| {what} | {paired_difference([a[s] - b[s] for s in seeds], words=('higher', 'lower'))} |")
    return "\n".join(lines)


def leakage_tables(results: dict[str, list[dict]]) -> str:
    leak = ["| run | seeds | codec | embeddings sent | recovered rows (mean) | true tokens (mean) | precision | "
            "recall |",
            "|---|---:|---|---|---:|---:|---:|---:|"]
    exposure = ["| run | protocol | parameter tensors received | boundary messages (forward keys) | exposure checks |",
                "|---|---|---:|---|---|"]
    for label, rows in results.items():
        first = rows[0]
        received = first["exposure"]["received"]
        forward = ", ".join(sorted(received.get("boundary", {}).get("forward", {})))
        boundary = f"{received['boundary_messages']} ({forward})" if "boundary_messages" in received else "none"
        violations = [v for r in rows for v in r["exposure"]["violations"]]
        exposure.append(f"| {label} | {first['protocol']} | {len(received['uploads'])} | {boundary} | "
                        f"{'pass' if not violations else 'FAIL: ' + '; '.join(violations)} |")
        codec = first["update_leakage"]["codec"]
        scored = [c for r in rows for c in r["update_leakage"]["clients"] if c.get("sent_embedding")]
        if scored:
            u = [r["update_leakage"] for r in rows]
            recovered, true = (statistics.mean(c[k] for c in scored) for k in ("recovered", "true"))
            leak.append(f"| {label} | {len(rows)} | {codec} | yes | {recovered:.0f} | {true:.0f} | "
                        f"{mean_sd([x['precision'] for x in u])} | {mean_sd([x['recall'] for x in u])} |")
        else:
            leak.append(f"| {label} | {len(rows)} | {codec} | no | | | | |")
    return "\n".join([*leak, "", *exposure])


def utility_table(results: dict[str, list[dict]]) -> str:
    """What the audited runs learnt: test accuracy (mean over the clients' evaluations) at round 0 and after the
    last round, so a setting that resists the attack can be weighed against what it costs."""
    lines = ["| run | seeds | test accuracy, round 0 | after the last round | per seed |", "|---|---:|---:|---:|---|"]
    for label, rows in results.items():
        lines.append(f"| {label} | {len(rows)} | {mean_sd([r['accuracy'][0] for r in rows])} | "
                     f"{mean_sd([r['accuracy'][1] for r in rows])} | "
                     + ", ".join(f"s{r['seed']}: {r['accuracy'][1]:.3f}" for r in rows) + " |")
    long = {r["seed"]: r["accuracy"][1] for r in results.get(LONG, [])}
    for lr, label in HOTTER.items():
        hot = {r["seed"]: r["accuracy"][1] for r in results.get(label, [])}
        if seeds := sorted(hot.keys() & long.keys()):
            diff = paired_difference([hot[s] - long[s] for s in seeds], words=("higher", "lower"))
            lines += ["", f"Final test accuracy, lr {lr} minus lr 1e-4 (10 rounds each), same seed: {diff}"]
    return "\n".join(lines)


def test_accuracy(metrics: dict) -> float | None:
    """A round's test accuracy: the global model's, or the mean of the clients' (personalised runs)."""
    return metrics.get("test_accuracy", metrics.get("test_accuracy_mean"))


def audit_tables(roots: list[Path]) -> str:
    """The activation-inversion table over seeds, its same-seed differences, what the runs learnt, update
    leakage and exposure."""
    results = audits(roots)
    return "\n\n".join([inversion_table(results), inversion_differences(results), utility_table(results),
                         leakage_tables(results)])


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


def mean_sd(values: list[float], digits: int = 3) -> str:
    """'mean ± sample sd' over seeds (the tables give the number of seeds), or the value alone from one seed."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def dp_table(results: dict[str, list[dict]]) -> str:
    lines = ["| setting | z | epsilon reported (delta 1e-5) | seeds | accuracy round 0 | final accuracy | "
             "final - round 0, same seed [95% interval] | per seed |", "|---|---:|---:|---:|---:|---:|---|---|"]
    order = sorted(results, key=lambda k: (results[k][0]["kind"] != "none", results[k][0]["kind"],
                                           -results[k][0]["epsilon"]))
    for label in order:
        rows = sorted(results[label], key=lambda r: r["seed"])
        eps = rows[0]["epsilon"]
        z = "-" if rows[0]["kind"] == "none" else f"{rows[0]['z']:.3f}"
        lines.append(f"| {label} | {z} | {'inf' if math.isinf(eps) else f'{eps:.2f}'} | {len(rows)} | "
                     f"{mean_sd([r['start'] for r in rows])} | {mean_sd([r['final'] for r in rows])} | "
                     f"{paired_difference([r['final'] - r['start'] for r in rows], words=('above', 'below'))} | "
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
