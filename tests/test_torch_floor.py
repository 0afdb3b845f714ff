"""The torch floor: pyproject.toml's requirement and the import-time check are the same version, the features the
floor is chosen for exist, and an older torch is refused by name when hfport is imported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfport.version import TORCH_MIN, check_torch, release

REPO = Path(__file__).resolve().parents[1]


def test_pyproject_requires_the_checked_floor():
    text = (REPO / "pyproject.toml").read_text()
    found = re.search(r'"torch>=([\d.]+)"', text)
    assert found, "pyproject.toml has no torch>= requirement"
    assert release(found.group(1))[:2] == TORCH_MIN


def test_the_floor_has_what_hfport_uses():
    assert release(torch.__version__)[:2] >= TORCH_MIN
    # the loop's clipping (hfport/train/loop.py clip_grad_norm) and the checkpoint reader's restricted loader
    assert callable(torch.nn.utils.get_total_norm) and callable(torch.nn.utils.clip_grads_with_norm_)
    assert "weights_only" in torch.load.__code__.co_varnames


@pytest.mark.parametrize("version", ["2.5.1", "2.4.0+cpu", "1.13.1"])
def test_an_older_torch_is_refused_by_name(version):
    with pytest.raises(ImportError, match=re.escape(f"torch {version} is installed")):
        check_torch(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.13.0+cpu", "2.6.0a0+git", "3.0"])
def test_the_floor_and_newer_pass(version):
    check_torch(version)


def test_importing_hfport_with_an_old_torch_fails_clearly():
    code = ("import importlib.metadata as m; real = m.version; "
            "m.version = lambda name: '2.5.1' if name == 'torch' else real(name); "
            "import hfport")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "hfport needs torch>=2.6" in done.stderr, done.stderr[-2000:]
