"""The int8 gate's statistics, kept under their export name: they live in hfport/agreement.py, a floor below, so
that loading with dtype="int8" (hfport/int8.py) judges by the same rules as the ONNX export."""

from ..agreement import *  # noqa: F401,F403
from ..agreement import (GATES, MIN_AGREEMENT, MIN_COSINE, GateContext, check_thresholds, gate_for, items,  # noqa: F401
                         measure, passes, verdict)
