"""Multiple-choice training and scoring on Gemma 3 270M (PubMedQA): the vocabulary head at the answer's positions
only, and one-token options scored from one pass over the prompt, against the way both ran before.

Gemma's head maps each position to 262,144 words, more multiply-adds per token than its 18 blocks. A
multiple-choice item trains on ``prompt + answer`` with the loss on the answer's one or two tokens, and is scored
by each option's log-likelihood. Side by side on the same PubMedQA items (lm-eval's prompt, cut to
``--max-length`` tokens), the same LoRA model (r 8, every linear layer), in one process, arms taking turns:

- training step (forward + backward, batch ``--batch``): the head over every position, then the answer's logits
  picked (before) / the answer's hidden states picked, then the head (now, ``next_token_logits``);
- scoring an item's 3 options: one forward per option, prompt + option (before, ``sequence_loglikelihoods``) /
  one forward of the prompt, every one-token option read from its next-token distribution (now, the task's
  evaluation).

Both arms must give the same loss and log-likelihoods (printed). CPU seconds would hide nothing here: wall
seconds, median of ``--repeats``.

    OMP_NUM_THREADS=2 python benchmarks/bench_choice_head.py [--items 8] [--max-length 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fedlm.config.sections import AdapterConfig
from fedlm.data.sources import load_source, resolve_data_dir
from fedlm.models.adapters import apply_adapter
from fedlm.models.build import build_model, build_tokenizer
from fedlm.models.heads import task_logits
from fedlm.tasks import get_task
from fedlm.tasks.base import IGNORE_INDEX, base_hidden
from fedlm.tasks.choice import sequence_loglikelihoods


def full_head_loss(model, batch) -> torch.Tensor:
    """The loss as computed before: logits at every position, the answer's picked afterwards."""
    logits = task_logits(model, base_hidden(model, batch))
    targets = batch["labels"][:, 1:]
    predicted = targets != IGNORE_INDEX
    return F.cross_entropy(logits[:, :-1][predicted].float(), targets[predicted])


def timed(fn) -> tuple[float, object]:
    began = time.perf_counter()
    out = fn()
    return time.perf_counter() - began, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=8, help="PubMedQA items (training batch = scored items)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    tokenizer = build_tokenizer("gemma3-270m", "gemma3_text", None, 0)
    model = build_model("gemma3_text", None, "clm", tokenizer, checkpoint="gemma3-270m", seed=0)
    lora = AdapterConfig(kind="lora", r=8, alpha=16.0, target_modules="all-linear")
    model = apply_adapter(lora, model, "clm", seed=0).model
    loaded = load_source("pubmedqa", resolve_data_dir())
    task = get_task("multiple_choice", options=loaded.label_names)
    rows = task.preprocess(loaded.splits["test"].select(range(args.items)), tokenizer, args.max_length).to_list()
    batch = task.collate(rows[: args.batch], torch.Generator())
    single = sum(all(len(ids) == 1 for ids in row["option_ids"]) for row in rows)

    def step(loss_fn) -> float:
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return loss.item()

    def old_scores() -> list[float]:
        pairs = [(row["input_ids"][: row["prompt_length"]], ids) for row in rows for ids in row["option_ids"]]
        return sequence_loglikelihoods(model, tokenizer.pad_token_id, pairs)

    def new_scores() -> list[float]:
        return [s for ll in task._eval_part(model, rows, {})["loglikelihoods"] for s in ll]

    arms = {
        "train step, head everywhere (before)": lambda: step(lambda: full_head_loss(model, batch)),
        "train step, head at the answer (now)": lambda: step(lambda: task.loss(model, batch)[0]),
        "score items, a pass per option (before)": lambda: torch.no_grad()(old_scores)(),
        "score items, one pass per prompt (now)": lambda: torch.no_grad()(new_scores)(),
    }
    results = {name: timed(fn)[1] for name, fn in arms.items()}  # warm-up, and the values compared
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, fn in arms.items():
            times[name].append(timed(fn)[0])
    seq = [len(row["input_ids"]) for row in rows]
    print(f"Gemma 3 270M + LoRA r 8, PubMedQA test items 1-{args.items} (lm-eval prompt, {min(seq)}-{max(seq)} "
          f"tokens), training batch {args.batch}, {single} of {len(rows)} items with one-token options, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}, median of {args.repeats}")
    print("| arm | seconds (median; runs) |\n|---|---|")
    for name, runs in times.items():
        print(f"| {name} | {statistics.median(runs):.2f} ({', '.join(f'{t:.2f}' for t in runs)}) |")
    names = list(arms)
    med = {name: statistics.median(runs) for name, runs in times.items()}
    print(f"training step: {med[names[0]] / med[names[1]]:.2f}x faster; loss before {results[names[0]]:.6f}, now "
          f"{results[names[1]]:.6f}")
    largest = max(abs(a - b) for a, b in zip(results[names[2]], results[names[3]], strict=True))
    print(f"scoring: {med[names[2]] / med[names[3]]:.2f}x faster; largest log-likelihood difference {largest:.2e}")


if __name__ == "__main__":
    main()
