"""The results index agrees with the results files it quotes (issue 36 item 7): the committed files pass
``recipes/results/check_index.py``, and the check finds a changed number and a broken anchor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "recipes" / "results"


def _check_index():
    spec = importlib.util.spec_from_file_location("check_index", RESULTS / "check_index.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_committed_index_agrees_with_its_results_files() -> None:
    found = _check_index().disagreements(RESULTS)
    assert not found, "\n".join(map(str, found))


def test_github_anchors_of_headings() -> None:
    check = _check_index()
    assert check.slug("Seeds for Table 6's fine-tuning columns (2026-11-24)") == \
        "seeds-for-table-6s-fine-tuning-columns-2026-11-24"
    assert check.slug("Claims of the paper and whether they hold here") == \
        "claims-of-the-paper-and-whether-they-hold-here"
    assert check.anchors("# Verdicts\ntext\n## Verdicts\n") == {"verdicts", "verdicts-1"}


def test_a_drifted_number_and_a_broken_anchor_are_found(tmp_path: Path) -> None:
    check = _check_index()
    (tmp_path / "a.md").write_text("# Results\n\nCentralized 184.25 ± 0.7; 1,035 MB; +0.024 [-0.010, +0.057]\n")
    row = "| claim | 184 | {} | holds | [a.md](a.md#{}) |\n"
    (tmp_path / "README.md").write_text(row.format("184.25, 1035 MB, +0.024 [-0.010, +0.057]", "results"))
    assert check.disagreements(tmp_path) == []
    (tmp_path / "README.md").write_text(row.format("184.3, 1,035 MB", "result"))
    found = [item.what for item in check.disagreements(tmp_path)]
    assert found == ["anchor #result", "number 184.3"]
