"""The autocast audit: which ops ran in which dtype, per module, in a run recorded with ``ops=True``."""

from __future__ import annotations

import pandas as pd

from mpscope.recording.autocast_policy import AUTOCAST_LOWP_OPS


def audit(run) -> pd.DataFrame:
    """Which ops ran in which dtype, per module: the autocast audit of a run recorded with ``ops=True``.

    Returns one row per (phase, module, op, in_dtypes, out_dtype) over all recorded steps, in first
    execution order, with ``calls`` (summed), ``max_reduction_len`` and three flags:

    * ``reduction_lowp``: a reduction (:data:`REDUCTIONS`) whose output is float16/bfloat16.
    * ``bypass``: an in-place or ``out=`` call of an op that autocast would cast
      (:data:`AUTOCAST_LOWP_OPS`) while autocast was on; autocast does not apply to those calls.
    * ``param_lowp``: a float16/bfloat16 ``nn.Parameter`` was an input while autocast was on
      (a parameter cast by hand with ``.half()``; autocast expects float32 parameters).

    Raises:
        ValueError: when the run has no audit table (it was not recorded with ``ops=True``).
    """
    table = run.tables.get("ops")
    if table is None:
        raise ValueError("this run has no op-level audit: record it with mpscope.record(model, ..., ops=True)")
    if table.empty:
        return pd.DataFrame(columns=["phase", "module", "op", "in_dtypes", "out_dtype", "calls",
                                     "max_reduction_len", "reduction_lowp", "bypass", "param_lowp"])
    t = table.copy()
    packet = t.op.str.split(".").str[1]
    t["reduction_lowp"] = t.reduction.ne("") & t.out_dtype.isin(["float16", "bfloat16"])
    t["bypass"] = t.autocast & (t.inplace | t.out_variant) & packet.isin(AUTOCAST_LOWP_OPS)
    keys = ["phase", "module", "op", "in_dtypes", "out_dtype"]
    out = t.groupby(keys, sort=False, observed=True).agg(
        calls=("calls", "sum"), max_reduction_len=("max_reduction_len", "max"),
        reduction_lowp=("reduction_lowp", "any"), bypass=("bypass", "any"), param_lowp=("param_lowp", "any"),
    )
    return out.reset_index()
