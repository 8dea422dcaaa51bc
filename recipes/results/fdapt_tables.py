"""Prints recipes/results/fdapt.md's tables from a finished `fedlm run recipes/fdapt.yaml` (runs/fdapt)."""

from pathlib import Path

from fedlm.run.downstream import downstream_scores
from fedlm.run.recorder import read_metrics, slug
from fedlm.run.report import summarize

ROOT = Path("runs/fdapt")
SETTINGS = ["original model", "centralized"]
SETTINGS += [f"clients={c},skew={s}" for c in (2, 8) for s in ("iid", "quantity", "length", "vocabulary")]
SETTINGS += [f"FFDAPT clients={c},skew={s}" for c in (2, 8) for s in ("iid", "quantity")]


def main() -> None:
    rows = {}
    print("| setting | MLM perplexity, held-out abstracts (start -> final) | PubMedQA accuracy "
          "| client train s/round | MB up / down |")
    print("|---|---|---|---|---|")
    for label in SETTINGS:
        run_dir = ROOT / slug(label)
        summary = summarize(read_metrics(run_dir), "perplexity", "min")
        accuracy = downstream_scores(run_dir)["pubmedqa accuracy"]
        rows[label] = (summary, accuracy)
        start, final, seconds = summary["start perplexity"], summary["final perplexity"], summary["train s/round"]
        trained = f"{start:.0f} -> {final:.0f}" if summary["rounds"] else f"{start:.0f} (no training)"
        timing = f"{seconds:.1f}" if seconds == seconds else "-"
        sent = f"{summary['MB up']:.0f} / {summary['MB down']:.0f}"
        print(f"| {label} | {trained} | {accuracy:.3f} | {timing} | {sent} |")
    print()
    print("| FFDAPT vs FDAPT | client train s/round FDAPT | FFDAPT | I = (T - T_F) / T_F "
          "| PubMedQA FDAPT / FFDAPT |")
    print("|---|---|---|---|---|")
    for clients in (2, 8):
        for skew in ("iid", "quantity"):
            plain, acc = rows[f"clients={clients},skew={skew}"]
            frozen, acc_f = rows[f"FFDAPT clients={clients},skew={skew}"]
            t, t_f = plain["train s/round"], frozen["train s/round"]
            saving = 100 * (t - t_f) / t_f
            print(f"| {clients} clients, {skew} | {t:.1f} | {t_f:.1f} | {saving:.1f}% | {acc:.3f} / {acc_f:.3f} |")


if __name__ == "__main__":
    main()
