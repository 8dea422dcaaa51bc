"""Local-training throughput on one device in each precision, side by side: tokens/s and MFU.

What runs is fedlm's own client loop, ``train_locally`` (batches collated on the CPU and moved to the device,
autocast, fp16 loss scaling, gradient clipping at 1.0, AdamW, the loss read back every step), on a
BERT-base-shaped sequence classifier (preset base: 768 wide, 12 blocks, 12 heads; vocab 30,522; random
init), batch 32 x seq 128 of random token ids. Every precision starts from the same weights, and the
precisions take turns (best of ``--repeats`` calls each) so that load from other processes hits them alike.

FLOPs per training step are estimated as 6 x N x tokens (2N forward + 4N backward per token), N = the
parameters a token meets as matrix multiplications: all but the embeddings, which are looked up. Attention's
own QK^T and AV products (12 x layers x seq x width per token, +2.8% at seq 128) are left out, so MFU is
slightly understated. MFU = achieved FLOP/s / the device's dense peak in that precision, from PEAK_TFLOPS
(vendor dense figures, no sparsity; fp32 is the plain FP32 rate, since torch runs fp32 matmuls without TF32
by default) or ``--peak-tflops``. No peak is known for CPUs, so there MFU is not reported unless given.

    python benchmarks/bench_device.py                       # device auto, fp32 vs bf16, BERT-base shape
    python benchmarks/bench_device.py --precisions fp32,bf16,fp16 --device cuda:0
    python benchmarks/bench_device.py --quick               # seconds: a tiny model, a smoke run on any device
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from fedlm.federation.local_training import LocalSettings, train_locally
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.device import AUTOCAST_DTYPES, check_precision, resolve_device
from fedlm.tasks import Task, get_task

WORDS = ["the", "a", "client", "server", "model", "trained", "shared", "weights", "river", "boats", "near", "every"]
# Dense peak TFLOP/s per precision, matched on the CUDA device name in this order (H100 PCIe before H100).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0}),
    ("H100 PCIe", {"fp32": 51.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0}),  # SXM
    ("A100", {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}),
    ("L40S", {"fp32": 91.6, "bf16": 362.0, "fp16": 362.0}),
    ("L4", {"fp32": 30.3, "bf16": 121.0, "fp16": 121.0}),
    ("A10", {"fp32": 31.2, "bf16": 125.0, "fp16": 125.0}),
    ("V100", {"fp32": 15.7, "fp16": 125.0}),
    ("T4", {"fp32": 8.1, "fp16": 65.0}),
]


def device_peak(device: torch.device, precision: str, override: float | None) -> tuple[float | None, str]:
    """The dense peak (TFLOP/s) MFU is measured against, and where it comes from."""
    if override is not None:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, f"no peak table for {device.type}"
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            peak = peaks.get(precision)
            return peak, f"{key} {precision} dense" if peak else f"{key} has no {precision} tensor cores"
    return None, f"{name} not in the table (pass --peak-tflops)"


def synthetic_rows(count: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """Full-length rows of random token ids (no padding) with random binary labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (count, seq), generator=gen)
    labels = torch.randint(2, (count,), generator=gen)
    return [{"input_ids": row, "labels": int(label)} for row, label in zip(ids.tolist(), labels, strict=True)]


def build(preset: str, vocab: int) -> tuple[torch.nn.Module, Task]:
    """The benchmark's classifier (random init, ``vocab`` token embeddings) and its task."""
    texts = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(12)) for i in range(64)]
    tokenizer = build_tokenizer(None, "bert", texts, 500)  # only its pad id is used: the rows are random ids
    model = build_model("bert", preset, "classification", tokenizer, num_labels=2, overrides={"vocab_size": vocab},
                        seed=0)
    return model, get_task("classification", tokenizer)


def matmul_params(model: torch.nn.Module) -> int:
    """N of the FLOP estimate: every parameter but the embedding tables (lookups, not matmuls)."""
    embeddings = sum(p.numel() for p in model.base_model.embeddings.parameters())
    return sum(p.numel() for p in model.parameters()) - embeddings


def timed_call(model: torch.nn.Module, task: Task, rows: list[dict], settings: LocalSettings,
               device: torch.device) -> float:
    """Seconds for one ``train_locally`` call of ``settings.local_steps`` steps, the device drained after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    train_locally(model, task, rows, settings, seed=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps (as train.device)")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--preset", default="base", choices=["tiny", "small", "base"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=30_522, help="embedding rows (BERT's vocabulary size)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per precision (best is kept)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak to measure MFU against")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--quick", action="store_true",
                        help="a seconds-long smoke run: tiny model, few steps, 1 CPU thread unless --threads")
    args = parser.parse_args()
    args.precisions = args.precisions.split(",")
    unknown = sorted(set(args.precisions) - {"fp32", *AUTOCAST_DTYPES})
    if unknown:
        parser.error(f"unknown precision(s) {', '.join(unknown)}: choose from fp32, bf16, fp16")
    if args.quick:
        args.preset, args.batch, args.seq, args.vocab, args.steps, args.repeats = "tiny", 8, 64, 2000, 3, 1
        args.threads = args.threads or 1  # a tiny model on a shared CPU: more threads mostly wait on each other
    return args


def best_step_seconds(models: dict[str, torch.nn.Module], task: Task, rows: list[dict], args: argparse.Namespace,
                      device: torch.device) -> dict[str, float]:
    """Seconds per step of each precision: one warm-up step each (kernel choice, allocator), then the best of
    ``args.repeats`` calls of ``args.steps`` steps, the precisions taking turns."""
    def settings(precision: str, steps: int) -> LocalSettings:
        return LocalSettings(lr=1e-4, batch_size=args.batch, local_steps=steps, precision=precision)

    for precision, model in models.items():
        timed_call(model, task, rows, settings(precision, 1), device)
    best = dict.fromkeys(models, float("inf"))
    for _ in range(args.repeats):
        for precision, model in models.items():
            seconds = timed_call(model, task, rows, settings(precision, args.steps), device)
            best[precision] = min(best[precision], seconds)
    return {precision: seconds / args.steps for precision, seconds in best.items()}


def report(step_s: dict[str, float], tokens: int, flops_per_step: float, device: torch.device,
           peak_override: float | None) -> None:
    """One row per precision: step time, tokens/s, achieved TFLOP/s, MFU and speed relative to the first."""
    first = next(iter(step_s))
    print(f"\n{'precision':<10}{'ms/step':>9}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'vs ' + first:>9}   peak")
    for precision, seconds in step_s.items():
        achieved = flops_per_step / seconds / 1e12
        peak, source = device_peak(device, precision, peak_override)
        mfu = f"{achieved / peak:.1%}" if peak else "n/a"
        print(f"{precision:<10}{seconds * 1e3:>9.1f}{tokens / seconds:>12,.0f}{achieved:>10.3g}{mfu:>8}"
              f"{step_s[first] / seconds:>8.2f}x   {source}{f' ({peak:g} TFLOP/s)' if peak else ''}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    for precision in args.precisions:
        check_precision(device, precision)
    base, task = build(args.preset, args.vocab)
    models = {precision: copy.deepcopy(base).to(device) for precision in args.precisions}
    tokens = args.batch * args.seq
    flops_per_step = 6 * matmul_params(base) * tokens
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"device {device} ({name}), torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(f"BERT preset {args.preset}, vocab {args.vocab}, classification; batch {args.batch} x seq {args.seq}; "
          f"N = {matmul_params(base) / 1e6:.1f}M non-embedding params; 6 x N x tokens = "
          f"{flops_per_step / 1e12:.3g} TFLOP per step")
    step_s = best_step_seconds(models, task, synthetic_rows(args.batch * args.steps, args.seq, args.vocab), args,
                               device)
    report(step_s, tokens, flops_per_step, device, args.peak_tflops)


if __name__ == "__main__":
    main()
