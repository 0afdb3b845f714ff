"""What the benchmark scripts share: naming the machine a figure was measured on.

Imported as `from _benchutil import ...` by scripts run as `python scripts/NAME.py` (the script's folder is then
first on sys.path). Nothing here imports transformers, so a measuring child process can use it too.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform

import torch


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _version(package: str) -> str:
    """The installed version, read from the package metadata so that asking does not import the package."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, str | int | float]:
    """CPU (or GPU), cores, RAM, library versions and torch's intra-op threads, for a report."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # sysconf names are not available everywhere
        ram = float("nan")
    return {"cpu": cpu_name(), "logical_cores": os.cpu_count() or 0, "ram_gib": round(ram, 1),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": _version("transformers"), "torch_threads": torch.get_num_threads()}


def describe(m: dict[str, str | int | float]) -> str:
    gpu = f", GPU {m['gpu']}" if m["gpu"] != "none" else ""
    return (f"{m['cpu']}, {m['logical_cores']} logical cores, {m['ram_gib']} GiB RAM{gpu}; Python {m['python']}, "
            f"torch {m['torch']} ({m['torch_threads']} intra-op threads), transformers {m['transformers']}")
