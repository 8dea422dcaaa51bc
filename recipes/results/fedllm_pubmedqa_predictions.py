"""What the models of recipes/fedllm-pubmedqa.yaml answer: the share of test items each predicts yes / no / maybe,
and how often it agrees with always answering "yes" (the majority class). Accuracy alone cannot tell a model that
read the abstracts from one that learnt the label prior; this can.

Each run's final model is rebuilt from its config (the same quantized base and adapter) and its last checkpoint,
and scored on its own test items as the run scored them (the log-probability of each one-token option after the
prompt); ``--start`` scores the untuned base instead (the adapter as initialised: LoRA's B = 0 adds nothing).
The accuracy printed must equal the run's own final (or round-0) test_acc: a check that the rebuild is faithful.

    .venv/bin/python recipes/results/fedllm_pubmedqa_predictions.py runs/fedllm-pubmedqa/setting=*_seed=0
    .venv/bin/python recipes/results/fedllm_pubmedqa_predictions.py --start \
        runs/fedllm-pubmedqa/setting=centralized_seed=0
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from fedlm.config import load_config
from fedlm.data.sources import resolve_data_dir
from fedlm.federation.params import load_into
from fedlm.run.prepare import prepare
from fedlm.run.recorder import RunRecorder
from fedlm.tasks.choice import next_token_logprobs

BATCH = 8


def predictions(run_dir: Path, data_dir: Path, start: bool) -> tuple[list[int], list[int], list[str], float]:
    """(predicted option, right option) per test item, the option names, and the run's own recorded accuracy."""
    config = load_config(run_dir / "config.yaml")
    prep = prepare(config, data_dir, cache_dir=run_dir.parent / ".cache")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not start:
        state = RunRecorder(run_dir).load_checkpoint()
        if state is None:
            raise SystemExit(f"{run_dir}: no checkpoint to rebuild the final model from")
        load_into(prep.model, state["global"])
    recorded = next(r["test_acc"] for r in (records if start else reversed(records)) if "test_acc" in r)
    model, pad = prep.model.eval(), prep.tokenizer.pad_token_id
    predicted: list[int] = []
    with torch.no_grad():
        for first in range(0, len(prep.test_rows), BATCH):
            rows = prep.test_rows[first:first + BATCH]
            logprobs = next_token_logprobs(model, pad, [row["input_ids"][: row["prompt_length"]] for row in rows])
            for row, scores in zip(rows, logprobs, strict=True):
                if any(len(ids) != 1 for ids in row["option_ids"]):
                    raise SystemExit("an option of more than one token: this diagnostic reads one-token options")
                predicted.append(int(scores[[ids[0] for ids in row["option_ids"]]].argmax()))
    names = prep.loaded.label_names or [str(i) for i in range(len(prep.test_rows[0]["option_ids"]))]
    return predicted, [row["label"] for row in prep.test_rows], names, recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run directories of recipes/fedllm-pubmedqa.yaml")
    parser.add_argument("--start", action="store_true", help="score the untuned base (round 0), not the final model")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    data_dir = args.data_dir or resolve_data_dir()
    print("| run | model | predicted yes / no / maybe | right yes / no / maybe | acc (recorded) | agrees with "
          "always-yes |")
    print("|---|---|---|---|---|---:|")
    for run_dir in args.runs:
        predicted, right, names, recorded = predictions(run_dir, data_dir, args.start)
        n = len(predicted)
        shares = Counter(predicted)
        truth = Counter(right)
        acc = sum(p == r for p, r in zip(predicted, right, strict=True)) / n
        print(f"| {run_dir.name} | {'untuned base' if args.start else 'final'} | "
              + " / ".join(f"{shares[i] / n:.2f}" for i in range(len(names))) + " | "
              + " / ".join(f"{truth[i] / n:.2f}" for i in range(len(names)))
              + f" | {acc:.3f} ({recorded:.3f}) | {shares[0] / n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
