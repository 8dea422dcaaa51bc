"""RTE posed as generation for recipes/fl-glm.yaml: the shared GLUE RTE files as a seq2seq JSONL directory.

Each example becomes ``{"text": "Does the passage support the claim? Answer yes or no.\\nClaim: <hypothesis>
\\nPassage: <premise>", "target": "yes" | "no"}`` (entailment -> yes); the claim comes before the passage so
that cutting a long source to ``model.max_length`` shortens the passage, never the question (at 128 tokens
~17% of RTE's training prompts are cut). The model must generate the answer word (one Gemma token) and then
end-of-text: with ``generation.max_new_tokens: 2`` ROUGE-L F of a one-word reference against at most two
generated tokens is 1 (the word alone), 0 (another word) or 0.67 (the word plus one more): exact-match
accuracy once the model has learnt to stop. train.jsonl
is GLUE's train split (2,490), test.jsonl its dev split (277; GLUE's test labels are hidden). The majority
answer's accuracy on the test file is printed: the shortcut a trained model has to beat.

    python recipes/results/fl_glm_rte.py /tmp/fl-glm/rte     # then: fedlm run recipes/fl-glm.yaml
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
from pathlib import Path

QUESTION = "Does the passage support the claim? Answer yes or no."
GLUE_RTE = Path(__file__).resolve().parents[3] / "shared" / "data" / "glue" / "RTE"


def prompts(tsv: Path) -> list[dict[str, str]]:
    with tsv.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    answer = {"entailment": "yes", "not_entailment": "no"}
    return [{"text": f"{QUESTION}\nClaim: {r['sentence2']}\nPassage: {r['sentence1']}",
             "target": answer[r["label"]]} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write train.jsonl and test.jsonl into")
    parser.add_argument("--glue-rte", type=Path, default=GLUE_RTE)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", "train.tsv"), ("test", "dev.tsv")):
        rows = prompts(args.glue_rte / name)
        with (args.out / f"{split}.jsonl").open("w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        counts = collections.Counter(row["target"] for row in rows)
        majority, top = counts.most_common(1)[0]
        print(f"{split}: {len(rows)} examples, {dict(counts)}; always '{majority}': {top / len(rows):.3f}")


if __name__ == "__main__":
    main()
