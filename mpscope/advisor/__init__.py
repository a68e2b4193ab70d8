"""The advisor: findings, bf16-vs-fp16 choice, loss-scale what-if and GradScaler replay.

Public names: :func:`advise`, :class:`Recommendation`, :class:`Finding`, :func:`simulate_scaler`,
:func:`scale_whatif`.
"""

from mpscope.advisor.finding import Finding
from mpscope.advisor.recommendation import Recommendation, advise, try_advise
from mpscope.advisor.scaler import scale_whatif, simulate_scaler

__all__ = ["advise", "try_advise", "Recommendation", "Finding", "simulate_scaler", "scale_whatif"]
