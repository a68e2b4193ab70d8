"""Op-level recording and its advice under one import, ``mpscope.ops``.

``record(model, ops=True)`` records every ATen op's output (:mod:`mpscope.recording.op_recorder`);
the autocast audit is :func:`audit` (:mod:`mpscope.recording.op_audit`); the findings from those
tables are :func:`op_findings` (:mod:`mpscope.advisor.op_findings`); the op lists they share are in
:mod:`mpscope.recording.autocast_policy`. New code imports from those modules.
"""

from mpscope.advisor.op_findings import op_findings
from mpscope.recording.autocast_policy import (
    AUTOCAST_LOWP_OPS,
    CPU_FP32_OPS,
    CUDA_FP32_OPS,
    MATMULS,
    PERIODIC,
    PERIODIC_ULP,
    POLES,
    PRESERVING,
    REDUCTIONS,
    SUMMING,
    check_op_filter,
    op_short_name,
)
from mpscope.recording.op_audit import audit
from mpscope.recording.op_recorder import SKIP_PRESERVING, OpRecorder
from mpscope.schema import AUDIT_COLUMNS, FACT_COLUMNS

__all__ = [
    "AUDIT_COLUMNS", "AUTOCAST_LOWP_OPS", "CPU_FP32_OPS", "CUDA_FP32_OPS", "FACT_COLUMNS", "MATMULS", "PERIODIC",
    "PERIODIC_ULP", "POLES", "PRESERVING", "REDUCTIONS", "SKIP_PRESERVING", "OpRecorder", "SUMMING", "audit",
    "check_op_filter", "op_findings", "op_short_name",
]
