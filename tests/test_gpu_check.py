"""The GPU acceptance script's smoke run (``benchmarks/gpu_check.py --quick``): every check runs end to end on
tiny models on the CPU, so the script a GPU session will run has not rotted by then."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
CHECKS = ("device: client loop", "quickstart round", "FL-GLM Table 3: client-batch", "QLoRA client")

pytest.importorskip("bitsandbytes")


def test_quick_run_fills_every_check(tmp_path, monkeypatch, one_thread):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_check

    out = tmp_path / "gpu_check.md"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--quick", "--device", "cpu", "--out", str(out)])
    gpu_check.main()  # exits 1 when any check fails
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    by_check = {check: [r for r in rows if r[0] == f"| {check}"] for check in CHECKS}
    assert all(by_check.values()), by_check
    assert not any("failed" in cell for row in rows for cell in row)
    # the comparisons each check exists for: client-batch against serial, the 4-bit base against fp32
    assert [r for r in by_check["FL-GLM Table 3: client-batch"] if "serial" in r[2] and "x" in r[2]]
    assert [r for r in by_check["QLoRA client"] if r[1] == "NF4 / fp32" and "base bytes" in r[2]]
