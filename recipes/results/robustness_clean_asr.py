"""The backdoor's baseline: how often a model trained WITHOUT attackers calls the triggered test sentences negative.

``robustness.md``'s backdoor cell reports the attack success rate (ASR: triggered positive test sentences
classified as the target label 0); its round-0 value is the untrained model's. What the attack adds is only what
lies above the rate a clean model gives the same triggered sentences, so this scores the final models of the
"clean iid" runs (FedAvg, the same seeds, the same test sentences) on the backdoor cell's triggered test set,
prepared exactly as the backdoor runs prepare it.

    .venv/bin/python recipes/results/robustness_clean_asr.py /tmp/robust/runs/robustness [--aggs mean]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import load_file

from fedlm.config import load_config
from fedlm.data.sources import resolve_data_dir
from fedlm.run.single import prepare_run

RECIPE = Path(__file__).resolve().parents[1] / "robustness.yaml"
BACKDOOR = ["attack.kind=backdoor", "attack.fraction=0.3", "attack.poison_share=0.5", "attack.target_label=0"]


def clean_asr(grid: Path, agg: str, seed: int, data_dir: Path) -> tuple[float, float]:
    """(ASR of the clean run's final model on the triggered test set, its clean test accuracy)."""
    config = load_config(RECIPE, [*BACKDOOR, f"seed={seed}", f"seeds=[{seed}]", "grid={}",
                                  f"output_dir={grid.parent / '.clean-asr'}"])
    prep = prepare_run(config, data_dir)
    run = grid / f"cell=clean_iid_agg={agg}_seed={seed}"
    missing, unexpected = prep.model.load_state_dict(load_file(run / "model" / "model.safetensors"), strict=False)
    if unexpected or [m for m in missing if "position_ids" not in m]:
        raise SystemExit(f"{run}: the saved model does not fit ({missing[:3]}, {unexpected[:3]})")
    prep.model.eval()
    with torch.no_grad():
        asr = prep.task.evaluate(prep.model, prep.triggered_test, batch_size=128, generator=torch.Generator())
        clean = prep.task.evaluate(prep.model, prep.test_rows, batch_size=128, generator=torch.Generator())
    return asr["accuracy"], clean["accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the robustness grid directory (its clean iid runs)")
    parser.add_argument("--aggs", nargs="+", default=["mean"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args()
    data_dir = resolve_data_dir()
    print("| clean iid run | seed | triggered sentences called negative (clean ASR) | clean test accuracy |")
    print("|---|---:|---:|---:|")
    for agg in args.aggs:
        for seed in args.seeds:
            asr, accuracy = clean_asr(args.grid, agg, seed, data_dir)
            print(f"| {agg} | {seed} | {asr:.3f} | {accuracy:.3f} |")


if __name__ == "__main__":
    main()
