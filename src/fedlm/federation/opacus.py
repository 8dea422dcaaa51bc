"""Opacus, the optional ``dp`` extra: imported on first use, and its accountants' epsilon (never a formula of ours)."""

from __future__ import annotations

import importlib
import math
from typing import Any

from fedlm.errors import UserError


def require_opacus(module: str) -> Any:
    """``opacus.<module>``, or one line naming the extra to install."""
    try:
        return importlib.import_module(f"opacus.{module}")
    except ImportError:
        raise UserError("differential privacy (privacy.kind client or sample) needs opacus: "
                        "pip install -c constraints.txt 'fedlm[dp]'") from None


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after ``steps`` subsampled Gaussian steps (rate ``sample_rate``, noise ``z``), by Opacus'
    accountant; 0 before any step, infinite without noise."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    accountants = require_opacus("accountants")
    ledger = accountants.PRVAccountant() if accountant == "prv" else accountants.RDPAccountant()
    ledger.history = [(noise_multiplier, min(1.0, sample_rate), steps)]
    return float(ledger.get_epsilon(delta))
