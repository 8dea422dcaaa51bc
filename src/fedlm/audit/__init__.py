"""Leakage audits of finished runs (`fedlm audit RUN_DIR`): what an honest-but-curious server could recover
from the messages it received (activation inversion for split runs, embedding-row update leakage for
parameter uploads), and checks that labels and token ids never reach it."""

from fedlm.audit.activation_audit import InversionSettings
from fedlm.audit.runner import audit_run

__all__ = ["InversionSettings", "audit_run"]
