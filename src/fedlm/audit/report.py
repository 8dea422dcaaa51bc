"""audit.json (every number) and audit.md (what a reader needs: one table per attack, the checks' verdict)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_audit(run_dir: Path, result: dict[str, Any]) -> None:
    (run_dir / "audit.json").write_text(json.dumps(result, indent=2))
    (run_dir / "audit.md").write_text(markdown(result))


def markdown(result: dict[str, Any]) -> str:
    start = f"the checkpoint of round {result['round'] - 1}" if result["round"] > 1 else "the starting weights"
    lines = [f"# Leakage audit of {result['run']}", "",
             f"Protocol {result['protocol']}; an honest-but-curious server, with public text "
             f"({result['public_text']}) as its only extra knowledge. Round {result['round']} recomputed "
             f"from {start} for clients {result['clients']}.", ""]
    inversion = result.get("activation_inversion")
    if inversion is not None:
        lines += [f"## Activation inversion (cut {tuple(inversion['cut'])}, {inversion['inverter']} inverter, "
                  f"{inversion['inverter_steps']} steps on {inversion['public_sequences']} public sequences, "
                  f"seed {inversion['inverter_seed']})", "",
                  "| client bottom | sequences | tokens | token accuracy | chance | BLEU-4 |",
                  "|---|---:|---:|---:|---:|---:|"]
        for name in ("untrained", "trained"):
            row = inversion[name]
            if row.get("sequences"):
                lines.append(f"| {name} | {row['sequences']} | {row['tokens']} | {row['token_accuracy']:.3f} | "
                             f"{row['chance_accuracy']:.3f} | {row['bleu4']:.2f} |")
        knows = "the trained bottom (the run shares it with the server)" if inversion[
            "attacker_knows_trained_bottom"] else "the public starting bottom only (the run keeps bottoms local)"
        lines += ["", f"For the trained row the attacker's inverter was fit on {knows}.", ""]
    leak = result.get("update_leakage")
    if leak is not None:
        lines += ["## Update leakage (changed embedding rows -> the client's token set)", "",
                  f"Embedding `{leak['embedding']}`, tied to the output layer: {leak['tied_to_output']}; codec "
                  f"{leak['codec']}.", "", "| client | sent embeddings | recovered | true | precision | recall |",
                  "|---|---|---:|---:|---:|---:|"]
        for row in leak["clients"]:
            if row["sent_embedding"]:
                lines.append(f"| {row['client']} | yes | {row['recovered']} | {row['true']} | "
                             f"{row['precision']:.3f} | {row['recall']:.3f} |")
            else:
                lines.append(f"| {row['client']} | no | | | | |")
        lines.append("")
    checks = result["exposure"]
    verdict = "pass" if not checks["violations"] else "FAIL"
    lines += ["## What the server received (labels: never; token ids: never)", "",
              f"Verdict: **{verdict}**" + "".join(f"\n- {v}" for v in checks["violations"]), "",
              "```", json.dumps(checks["received"], indent=1), "```", ""]
    if result.get("failures"):
        lines += ["Clients whose recomputed round failed: " + ", ".join(
            f"{c} ({why})" for c, why in result["failures"].items()), ""]
    return "\n".join(lines)
