"""Seeing what mixed precision does: `audit()` and its report, callbacks, telemetry.

The face of the subpackage: the audit (`auditor.py`, its per-layer checks in
`layer_checks.py`, its report in `audit_report.py`), the training callbacks (`callbacks.py`:
`kmp.callbacks`; the checkpoint ones in `checkpoint.py` and `backup.py`, with a backup's
extra state in `backup_state.py` and the resume's input checks in `resume_input.py`) and
the loss-scale telemetry they share (`telemetry.py`).
"""

from keras_mp.observe import callbacks, telemetry
from keras_mp.observe.audit_report import AuditReport, LayerAudit, VariableAudit
from keras_mp.observe.auditor import audit
from keras_mp.observe.callbacks import LossScaleCollapseError

__all__ = [
    "AuditReport",
    "LayerAudit",
    "LossScaleCollapseError",
    "VariableAudit",
    "audit",
    "callbacks",
    "telemetry",
]
