"""The package version, in a module of its own so that any part of hfport can read it without importing the
package root (which imports everything); and the oldest torch hfport runs on, checked when hfport is imported.

Why torch 2.6: the training loop clips with `torch.nn.utils.get_total_norm` and `clip_grads_with_norm_` (new in
2.6), and checkpoints are read with `torch.load(weights_only=True)`, which before 2.6 could still run code from a
crafted file (CVE-2025-32434). pyproject.toml's `torch>=` says the same (a test holds the two together).
"""

from __future__ import annotations

import re
from importlib import metadata

__version__ = "0.1.0"

TORCH_MIN = (2, 6)


def release(version: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); a pre-release ('2.6.0a0') counts as its release."""
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def check_torch(version: str | None = None) -> None:
    """ImportError naming the installed torch when it is older than TORCH_MIN. Read from the package metadata, so
    the check costs no torch import."""
    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise ImportError("hfport needs torch>=%d.%d; install it first (pip install torch)" % TORCH_MIN) from None
    if release(version)[:2] < TORCH_MIN:
        raise ImportError(f"hfport needs torch>={TORCH_MIN[0]}.{TORCH_MIN[1]} (gradient clipping helpers and a "
                          f"weights_only loader without CVE-2025-32434); torch {version} is installed")


check_torch()
