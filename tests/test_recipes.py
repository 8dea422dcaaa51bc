"""Every shipped recipe still loads, and every run of its grid (seeds, baselines, downstream fine-tuning) is a valid
config: a renamed or tightened config key breaks here, not in a reader's hour-long run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedlm.config import load_config
from fedlm.config.grid import downstream_config, expand_runs

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def test_the_recipes_are_found():
    assert {"quickstart.yaml", "fedbert-roberta.yaml", "fl-glm-dialogsum.yaml"} <= {p.name for p in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_run_of_a_recipe_is_a_valid_config(recipe):
    config = load_config(recipe)
    runs = expand_runs(config)
    assert runs and len({run.label for run in runs}) == len(runs)  # each run gets its own directory
    for run in runs:
        for name in run.config.downstream:
            downstream_config(run.config, name, "checkpoint-placeholder")
