"""The probe, calibration and judged texts, kept under their export name: they live in hfport/probes.py, a floor
below, so that loading with dtype="int8" (hfport/int8.py) calibrates and judges on the same texts as the export."""

from ..probes import *  # noqa: F401,F403
from ..probes import (CALIBRATION_PAIRS, CALIBRATION_TEXTS, GATE_MAX_LENGTH, PROBE_MAX_LENGTH, GateData,  # noqa: F401
                      encode, gate_batches, judged_length, long_pairs, long_texts, read_gate_data)
