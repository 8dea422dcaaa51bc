"""``eval.select: best``: the model a run delivers is the one of its evaluated round with the best validation
headline, not the last round's (model selection on held-out data, as fine-tuning protocols report it)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from fedlm.federation.params import NamedTensors
from fedlm.run.report import best_validation_round

Evaluate = Callable[[int, NamedTensors, list[int]], dict[str, Any]]


class BestOnValidation:
    """Follows the validation headline over a run's evaluations and keeps the global parameters of the best
    round in ``path`` (safetensors, replaced atomically), so a resumed run still has them. ``records``: the
    rounds a resumed run already has (their best is the one to beat)."""

    def __init__(self, path: Path, metric: str, direction: str, records: Sequence[dict[str, Any]]) -> None:
        self.path, self.metric, self.direction = path, metric, direction
        found = best_validation_round(records, metric, direction)
        self.best = None if found is None else found[1]
        if found is None:
            path.unlink(missing_ok=True)  # a new run: nothing of an earlier attempt's is the best of this one

    def watching(self, evaluate: Evaluate) -> Evaluate:
        """``evaluate`` that also keeps the parameters it scored when their validation score is the best yet."""

        def scored(round_idx: int, global_params: NamedTensors, clients: list[int]) -> dict[str, Any]:
            scores = evaluate(round_idx, global_params, clients)
            self.observe(round_idx, global_params, scores.get(f"val_{self.metric}"))
            return scores

        return scored

    def observe(self, round_idx: int, global_params: NamedTensors, value: Any) -> None:
        if not isinstance(value, int | float) or not math.isfinite(value):
            return
        if self.best is not None and not (value > self.best if self.direction == "max" else value < self.best):
            return
        self.best = float(value)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".partial")
        save_file({name: t.detach().contiguous() for name, t in global_params.items()}, partial,
                  metadata={"round": str(round_idx), f"val_{self.metric}": repr(self.best)})
        os.replace(partial, self.path)

    def params(self, final: NamedTensors) -> NamedTensors:
        """What the run delivers: the best round's parameters (``final`` where no round had a validation score)."""
        return load_file(self.path) if self.path.is_file() else final
