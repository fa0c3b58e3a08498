"""DP sync of the fast replicas: Streaming DiLoCo per pipeline stage (``diloco``, the only module that
touches torchft's internals) with PowerSGD pseudo-gradients (``powersgd``), the outer step and its
wire form (``outer``), torchft set-up (``ft``), and the per-step peers a user would pick instead
(``baselines``)."""

from .diloco import StreamingDiLoCo
from .outer import OuterUpdate, outer_optimizer
from .powersgd import PowerSGD, decode, power_iteration

__all__ = ["OuterUpdate", "PowerSGD", "StreamingDiLoCo", "decode", "outer_optimizer", "power_iteration"]
