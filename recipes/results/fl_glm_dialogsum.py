"""DialogSum posed as prompted summarisation for recipes/fl-glm-dialogsum.yaml: a seq2seq JSONL directory.

Each example becomes ``{"text": "Summarize the dialogue in one sentence.\\n<dialogue>", "target": <summary>}``;
the instruction comes first so that cutting a long dialogue to the prompt budget shortens the dialogue, never
the instruction. train.jsonl is DialogSum's train split, test.jsonl its test split with the first of its three
reference summaries (as ``data.source: dialogsum`` reads it). Prints the Gemma-token lengths of the prompts and
summaries when a tokenizer directory is given, which is what ``model.max_length`` and
``generation.max_new_tokens`` are chosen from.

    python recipes/results/fl_glm_dialogsum.py /tmp/fl-glm/dialogsum   # then: fedlm run recipes/fl-glm-dialogsum.yaml
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INSTRUCTION = "Summarize the dialogue in one sentence."
DIALOGSUM = Path(__file__).resolve().parents[3] / "shared" / "data" / "dialogsum"


def prompts(jsonl: Path, summary_key: str) -> list[dict[str, str]]:
    with jsonl.open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [{"text": f"{INSTRUCTION}\n{row['dialogue']}", "target": row[summary_key]} for row in rows]


def quantiles(lengths: list[int]) -> str:
    ordered = sorted(lengths)
    pick = {q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.5, 0.9, 0.99)}
    return " ".join(f"p{round(q * 100)} {n}" for q, n in pick.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write train.jsonl and test.jsonl into")
    parser.add_argument("--dialogsum", type=Path, default=DIALOGSUM)
    parser.add_argument("--tokenizer", type=Path, help="a tokenizer directory (e.g. the converted Gemma cache)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    for split, key in (("train", "summary"), ("test", "summary1")):
        rows = prompts(args.dialogsum / f"dialogsum.{split}.jsonl", key)
        with (args.out / f"{split}.jsonl").open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{split}: {len(rows)} examples")
        if tokenizer is not None:
            head = rows[:500]
            for column in ("text", "target"):
                lengths = [len(tokenizer(row[column])["input_ids"]) for row in head]
                print(f"  {column} tokens (first {len(head)}): {quantiles(lengths)}")


if __name__ == "__main__":
    main()
