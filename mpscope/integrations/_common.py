"""What the framework callbacks share: the numbers they log, and the end of a recording.

Framework-free: the callbacks in :mod:`mpscope.integrations.hf` and
:mod:`mpscope.integrations.lightning` call these with the recorder they own.
"""

from __future__ import annotations

import math

from mpscope.advisor import try_advise
from mpscope.recorder import Recorder, check_options
from mpscope.run import run_format as _run_format
from mpscope.schema import SHORT_NAMES
from mpscope.summary import text_summary


class CallbackState:
    """The options and results every framework callback holds (set up by its ``__init__``).

    Args:
        every: record stats every ``every``-th optimizer step (steps 0, every, 2*every, ...).
        out: directory the Run is written to as training goes (``out=`` of :func:`mpscope.record`:
            each rank's rows every few steps, the merged Run when training ends;
            ``mpscope.Run.load(out)``), or None. A process killed while training keeps the steps
            written so far.
        modules, roles, hist_every, max_steps, ops: as for :func:`mpscope.record`.
        log: add the summary numbers to the framework's logs.
        show: print the summary and recommendation when training ends.

    Attributes:
        run: the :class:`mpscope.Run` (filled during training; complete when training ends).
        recommendation: the :class:`mpscope.Recommendation` computed when training ends (None before).
        recorder: the live :class:`mpscope.Recorder` during training, else None.

    Raises:
        TypeError, ValueError: bad recording options, at construction rather than at train start.
    """

    def __init__(self, every: int = 1, out=None, *, modules=None, roles=None, hist_every: int = 1,
                 max_steps: int | None = None, ops: bool = False, log: bool = True, show: bool = True):
        self.options = dict(every=every, modules=modules, roles=roles, hist_every=hist_every,
                            max_steps=max_steps, ops=ops)
        check_options(**self.options)
        self.out, self.log, self.show = out, log, show
        self.run = None
        self.recommendation = None
        self.recorder: Recorder | None = None
        self._ended_at = 0


#: Prefix of the keys the callbacks add to the framework's logs (TensorBoard / W&B panel names).
LOG_PREFIX = "mpscope/"


#: Short names of the low-precision formats, as in the ``Run.tensors`` fraction columns.
def run_format(run) -> str | None:
    """The low-precision format ``run`` computes in, short: ``"fp16"`` or ``"bf16"``, None for a
    float32 run (:func:`mpscope.run.run_format`'s rules)."""
    fmt = _run_format(run)
    return SHORT_NAMES[fmt] if fmt else None


def log_numbers(recorder: Recorder) -> dict[str, float]:
    """A few summary numbers of the run so far, for the framework's loggers.

    Returns (keys prefixed with ``mpscope/``; only those with data):

    * ``loss_scale``: the GradScaler's scale after the last step on the host (absent without a scaler);
    * ``skipped_steps``: steps whose optimizer step did not run, so far;
    * ``nonfinite_tensors``: rows with an inf or NaN element in the last recorded step;
    * ``<fmt>_underflow_frac``, ``<fmt>`` the format the run computes in (:func:`run_format`:
      ``fp16_underflow_frac`` for a float16 run, ``bf16_underflow_frac`` for a bfloat16 run): the
      largest fraction of non-zero gradient elements (activation or parameter gradients, as
      recorded, i.e. multiplied by the loss scale where it was in effect) that become 0 when cast
      to that format, in the last recorded step. A float32 run (no autocast, no low-precision
      parameters) casts nothing: it gets ``hypothetical_fp16_underflow_frac`` and
      ``hypothetical_bf16_underflow_frac``, what each format would flush, named so that they are
      not read as something that happened. A run never gets the fraction of a format it did not use.

    Steps between two recorded steps reach the host with the next recorded step, so the numbers
    may lag by up to ``every`` steps.
    """
    run = recorder.run
    out: dict[str, float] = {}
    steps = run.steps
    if not len(steps):
        return out
    out["skipped_steps"] = float(steps.skipped.sum())
    if run.meta.get("scaler"):
        out["loss_scale"] = float(steps.scale_after.iloc[-1])
    recorded = steps[steps.recorded]
    if len(recorded):
        t = run.tensors
        last = t[t.step == int(recorded.step.iloc[-1])]
        out["nonfinite_tensors"] = float(((last.nan_count + last.inf_count) > 0).sum())
        grads = last[last.role.isin(["activation_grad", "param_grad"])]
        if len(grads):
            fmt = run_format(run)
            for short, key in ([(fmt, fmt)] if fmt else [(s, f"hypothetical_{s}") for s in ("fp16", "bf16")]):
                out[f"{key}_underflow_frac"] = float(grads[f"{short}_underflow_frac"].max())
    return {LOG_PREFIX + k: v for k, v in out.items() if not math.isnan(v)}


def finish(recorder: Recorder, show: bool, print_fn=print, error: BaseException | None = None):
    """Close ``recorder`` (its last step ends, every hook is removed, its ``out=`` files are
    completed), and print the recommendation when ``show``. ``error``: the exception training
    ended with, if any (it stays the one raised: mpscope's own troubles closing only warn).

    Returns ``(run, recommendation)``; the recommendation is None when the advisor failed (the
    error is printed; the Run is kept and written either way).
    """
    recorder.__exit__(type(error) if error is not None else None, error, None)
    run = recorder.run
    advice, e = try_advise(run)
    if e is not None:  # a failing advisor must not lose the recorded run
        print_fn(f"mpscope: the advisor failed ({type(e).__name__}: {e}); the run is kept.")
    if show and advice is not None:
        print_fn(text_summary(run, advice))
    return run, advice
