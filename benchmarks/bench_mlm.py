"""Masked-LM training throughput on this machine, and what the masked-positions-only head buys.

(a) fp32 matmul peak: torch.matmul of 3072 x 3072 matrices, in GFLOP/s, best of several samples. Each sample
    is a burst of 8 matmuls, a few seconds like one training step, so a busy machine cannot flatter the peak
    with a lucky quiet half second that the much longer step never gets.
(b) BERT-small (hidden 512, 4 layers, 8 heads, intermediate 2048, seq 128, batch 32, vocab 30,522) masked-LM
    training step through fedlm's MaskedLMTask (forward + backward + AdamW): tokens/s, achieved GFLOP/s and
    its fraction of (a). FLOPs per step are counted as
        6 x N_enc x tokens                      N_enc = encoder parameters without embeddings or MLM head
      + 12 x L x T x H x tokens                 attention scores and weighted sum (QK^T, AV), fwd + bwd
      + 6 x (H^2 + H x V) x masked tokens       MLM head (transform + vocabulary projection), masked rows only
    and the fraction is also shown without the head term (the plain "6 x non-embedding params" convention).
(c) forward + backward of the loss on one batch: stock BertForMaskedLM(labels=...), which projects every
    position onto the 30,522-word vocabulary, versus the masked-positions-only head; whole model and head
    alone (from fixed hidden states).

Targets: (b) >= 50% of peak, (c) >= 2x. Timings keep the best of several runs, and what is compared runs in
alternation ((a) with (b), the two sides of (c)), so that load from other processes hits both alike.

    python benchmarks/bench_mlm.py [--steps 5] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.heads import mlm_head
from fedlm.tasks.mlm import MaskedLMTask

BERT_SMALL = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "intermediate_size": 2048}
SEQ, BATCH, VOCAB = 128, 32, 30_522
MATMUL_SIZE, MATMUL_BURST = 3072, 8


def best_times(fns: list[Callable[[], object]], repeats: int, warmup: int = 1) -> list[float]:
    """Best wall time of each function; the functions take turns so load spikes hit all of them alike."""
    for fn in fns * warmup:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def matmul_burst(size: int = MATMUL_SIZE, count: int = MATMUL_BURST) -> tuple[Callable[[], None], float]:
    """``count`` square fp32 matmuls back to back, and their FLOPs."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)

    def burst() -> None:
        for _ in range(count):
            torch.matmul(a, b, out=out)

    return burst, 2.0 * size**3 * count


def make_batch(task: MaskedLMTask, tokenizer, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    special = torch.tensor(tokenizer.all_special_ids)
    vocab = torch.arange(len(tokenizer))
    ordinary = vocab[~torch.isin(vocab, special)]
    body = ordinary[torch.randint(len(ordinary), (BATCH, SEQ - 2), generator=gen)]
    cls = torch.full((BATCH, 1), tokenizer.cls_token_id)
    sep = torch.full((BATCH, 1), tokenizer.sep_token_id)
    rows = [{"input_ids": row} for row in torch.cat([cls, body, sep], dim=1).tolist()]
    return task.collate(rows, gen)


def step_flops(model, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(FLOPs without the MLM head term, FLOPs of the MLM head at masked rows) for one training step."""
    config = model.config
    hidden, layers, tokens = config.hidden_size, config.num_hidden_layers, batch["input_ids"].numel()
    encoder = sum(p.numel() for p in model.bert.encoder.parameters())
    masked = int((batch["labels"] != -100).sum())
    body = 6 * encoder * tokens + 12 * layers * SEQ * hidden * tokens
    head = 6 * (hidden * hidden + hidden * config.vocab_size) * masked
    return body, head


def bench_peak_and_training(model, task: MaskedLMTask, batch, steps: int) -> None:
    """(a) and (b), timed in alternation so that both see the same machine load."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()

    def step() -> None:
        loss, _ = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    burst, burst_flops = matmul_burst()
    burst_s, seconds = best_times([burst, step], steps, warmup=2)
    peak = burst_flops / burst_s / 1e9
    print(f"(a) matmul peak: {peak:.1f} GFLOP/s ({MATMUL_SIZE}^3 fp32, bursts of {MATMUL_BURST}, best of {steps})")
    body, head = step_flops(model, batch)
    tokens = batch["input_ids"].numel()
    achieved, achieved_body = (body + head) / seconds / 1e9, body / seconds / 1e9
    print(f"(b) BERT-small MLM train step (fwd+bwd+AdamW), batch {BATCH} x seq {SEQ}, vocab {VOCAB}:")
    print(f"    best step {seconds * 1e3:.0f} ms   {tokens / seconds:,.0f} tokens/s")
    print(f"    FLOPs/step: encoder+attention {body / 1e9:.1f} G, MLM head at masked rows {head / 1e9:.1f} G")
    print(f"    achieved {achieved:.1f} GFLOP/s = {achieved / peak:.1%} of peak   (target >= 50%)")
    print(f"    without the head term: {achieved_body:.1f} GFLOP/s = {achieved_body / peak:.1%} of peak")


def bench_head(model, task: MaskedLMTask, batch, repeats: int) -> None:
    model.train()

    def stock() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    def ours() -> None:
        model.zero_grad(set_to_none=True)
        task.loss(model, batch)[0].backward()

    hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0].detach()
    hidden.requires_grad_(True)
    labels = batch["labels"]
    selected = labels != -100
    head = mlm_head(model)
    ce = torch.nn.functional.cross_entropy

    def stock_head() -> None:
        ce(model.cls(hidden).view(-1, VOCAB), labels.view(-1)).backward()

    def our_head() -> None:
        ce(head(hidden[selected]), labels[selected]).backward()

    masked = int(selected.sum())
    print(f"(c) loss forward+backward on one batch ({masked} of {labels.numel()} tokens masked):")
    for name, (slow, fast) in {"whole model": (stock, ours), "head only": (stock_head, our_head)}.items():
        slow_s, fast_s = best_times([slow, fast], repeats)
        print(
            f"    {name:<11}  stock BertForMaskedLM(labels=...) {slow_s * 1e3:7.0f} ms   "
            f"masked-positions head {fast_s * 1e3:7.0f} ms   speedup {slow_s / fast_s:.2f}x   (target >= 2x)"
        )


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--steps", type=int, default=5, help="timed repeats of (a) and (b); best is kept")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per side of (c); best is kept")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32")

    tokenizer = build_tokenizer("minilm", "bert", None, VOCAB)  # the 30,522-word BERT uncased vocabulary
    model = build_model("bert", "small", "mlm", tokenizer, overrides=BERT_SMALL, seed=0)
    task = MaskedLMTask(tokenizer)
    batch = make_batch(task, tokenizer)
    bench_peak_and_training(model, task, batch, args.steps)
    bench_head(model, task, batch, args.repeats)


if __name__ == "__main__":
    main()
