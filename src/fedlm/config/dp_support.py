"""Which model families and tasks sample-level DP-SGD (Opacus) runs on: the one table the config checks when it
names its task and the run checks once ``task: auto`` has resolved."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Support:
    families: tuple[str, ...]
    tasks: tuple[str, ...]

    def refusal(self, family: str, task: str) -> str | None:
        """Why DP-SGD cannot train ``family`` on ``task`` (``auto``: not known yet, not judged), or None."""
        if family not in self.families:
            return (f"privacy.kind sample (Opacus DP-SGD) supports model.family {', '.join(self.families)}; not "
                    f"{family}: use one of these, or privacy.kind client")
        if task != "auto" and task not in self.tasks:
            return (f"privacy.kind sample (Opacus DP-SGD) supports tasks {', '.join(self.tasks)}; task {task} is not "
                    "one of them (its head's parameters are outside the layers Opacus knows): use privacy.kind client")
        return None


# families: Opacus computes their per-example gradients (tests/test_privacy.py trains each). Tasks: BERT-style MLM
# heads hold a parameter outside any layer Opacus knows, and its fallback cannot trace it; QA scores windows, not
# examples; seq2seq is left out (encoder-decoders fail the same way as MLM heads)
SAMPLE_DP = Support(families=("bert", "roberta", "distilbert", "gpt2", "llama"),
                    tasks=("classification", "regression", "clm", "tagging"))
