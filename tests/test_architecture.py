"""The layering rules: one owner of the run folder (RunDir), failed items as values (ItemError) rendered only by the
CLI and the HTTP layer, the library never importing the server, and the server using only hfport's public API."""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import hfport
from hfport import ItemError, RunDir, RunSummary, verbosity
from hfport.pipelines import DEFAULT_MAX_BATCH_TOKENS, Feature, Pipeline, PipelineInputError
from hfport.rundir import RUN_FILES, RunDirError

REPO = Path(__file__).resolve().parents[1]
# the submodules the server may import from, besides the top-level names in hfport.__all__ (hfport/__init__.py's
# docstring lists them as public)
PUBLIC_MODULES = ("hfport", "hfport.errors", "hfport.train", "hfport.export", "hfport.rundir", "hfport.pipelines",
                  "hfport.tasks", "hfport.embeddings", "hfport.verbosity", "hfport.lora", "hfport.retrieval",
                  "hfport.evaluation", "hfport.settings")


# --- RunDir ---------------------------------------------------------------------------------------------------


def _checkpoint(run: RunDir, step: int, complete: bool = True) -> Path:
    folder = run.checkpoint(step)
    folder.mkdir(parents=True)
    if complete:
        (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    return folder


def test_rundir_latest_checkpoint_and_resume_point(tmp_path):
    run = RunDir(tmp_path / "out")
    assert run.latest_checkpoint() is None and run.resume_point() is None and run.existing() == []
    assert not RunDir.is_run(run.root)
    _checkpoint(run, 2)
    four = _checkpoint(run, 4)
    _checkpoint(run, 6, complete=False)  # killed mid-write: never a resume point
    assert run.checkpoint_steps() == [2, 4, 6]
    assert run.latest_checkpoint() == four  # no pointer: the newest complete one
    run.set_latest(run.checkpoint(2))
    assert run.latest_pointer.read_text() == "step-2\n"
    assert run.latest_checkpoint() == run.checkpoint(2)  # the pointer wins while it names a complete checkpoint
    run.set_latest(run.checkpoint(6))
    assert run.latest_checkpoint() == four
    point = run.resume_point()
    assert point is not None and point.checkpoint == four and point.step == 4
    assert RunDir.is_run(run.root) and run.existing() == ["checkpoints"]
    assert RunDir.containing(four) == run and RunDir.containing(tmp_path) is None


def test_set_latest_takes_a_temporary_name_of_its_own(tmp_path, monkeypatch):
    """`latest` is written beside itself under a name of this write's own, then renamed: a killed run's leftover
    .latest.tmp is neither in the way nor published, a second writer (a second process on the run folder) that
    writes and renames between this one's write and rename neither takes nor removes this one's file (a fixed
    .latest.tmp made this rename fail with FileNotFoundError), and a failed rename leaves the pointer as it was and
    no temporary file behind (the fixed name stayed)."""
    run = RunDir(tmp_path / "out")
    two, four = _checkpoint(run, 2), _checkpoint(run, 4)
    (run.checkpoints / ".latest.tmp").write_text("step-")  # killed mid-write by an earlier run
    real_replace, seen = os.replace, []

    def second_writer_first(src, dst, *args, **kwargs):  # another process's whole set_latest, then this rename
        if not seen:
            seen.append(src)
            run.set_latest(four)
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", second_writer_first)
    run.set_latest(two)
    assert run.latest_pointer.read_text() == "step-2\n"  # whole: the last rename's, this writer's
    assert run.latest_checkpoint() == two
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [".latest.tmp", "latest", "step-2", "step-4"]

    def disk_full(src, dst, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space left"):
        run.set_latest(four)
    monkeypatch.setattr(os, "replace", real_replace)
    assert run.latest_pointer.read_text() == "step-2\n"
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [".latest.tmp", "latest", "step-2", "step-4"]
    assert (run.checkpoints / ".latest.tmp").read_text() == "step-"  # the leftover is not this run's to publish


def test_rundir_models_clear_and_which(tmp_path):
    run = RunDir(str(tmp_path / "out"))
    assert isinstance(run.root, Path)
    (run.best).mkdir(parents=True)
    (run.best / "config.json").write_text("{}")
    run.final.mkdir()
    run.metrics.write_text("{}\n")
    (run.root / "mine.txt").write_text("not the run's")
    assert run.models() == ["best"] and RunDir.containing(run.best) == run
    assert run.model("final") == run.final
    with pytest.raises(RunDirError, match="which='middle'"):
        run.model("middle")
    assert set(run.existing()) == {"best", "final", "metrics.jsonl"} <= set(RUN_FILES)
    run.clear()
    assert run.existing() == [] and (run.root / "mine.txt").read_text() == "not the run's"


def test_run_summary_round_trip(tmp_path):
    summary = RunSummary(steps=12, epochs=3, best_metric={"accuracy": 0.75}, best_step=8, stopped_early=False,
                         metric_mode="max", frozen=0, train_examples=64, eval_examples=16,
                         labels={0: "negative", 1: "positive"}, problem_type="single_label_classification",
                         config={"model": "m", "max_steps": 12}, final_eval={"eval_accuracy": 0.75})
    run = RunDir(tmp_path)
    summary.write(run.summary_path)
    assert json.loads(run.summary_path.read_text())["labels"] == {"0": "negative", "1": "positive"}
    back = run.summary()
    assert back == summary and back.labels == {0: "negative", 1: "positive"}  # int keys again
    assert "config" not in back.to_dict(with_config=False)
    # no evaluation: summary.json has no final_eval key, as the loop always wrote it
    bare = RunSummary(**{**summary.to_dict(), "final_eval": None, "labels": None})
    assert "final_eval" not in bare.to_dict()
    assert RunSummary.from_dict(bare.to_dict()) == bare
    run.summary_path.write_text('{"steps": 1}')
    with pytest.raises(RunDirError, match=r"summary.json: missing \['best_metric'"):
        run.summary()
    run.summary_path.write_text("[1, 2]")
    with pytest.raises(RunDirError, match="expected a JSON object"):
        run.summary()


# --- ItemError: a value in Python, {"error", "error_type", "index"} in the CLI and over HTTP ----------------------


class FakePipe(Pipeline):
    """Answers every item but "bad", which gets an ItemError; records the items of each forward pass (a library
    call's, or the server's across requests)."""

    task = "text-classification"
    defaults: ClassVar[dict[str, object]] = {}

    def __init__(self) -> None:  # no model: forward_batch below stands in for it
        self.calls: list[list[str]] = []
        self.options, self.adapters, self.batch_size = {}, {}, None
        self.max_batch_tokens, self.max_positions = DEFAULT_MAX_BATCH_TOKENS, None

    def preprocess(self, item: str, opts: dict) -> list[Feature]:
        return [Feature(item=-1, input_ids=[0], attention_mask=[1], token_type_ids=None, data={"text": item})]

    def forward_batch(self, batch: list[Feature]) -> None:
        self.calls.append([f.data["text"] for f in batch])

    def postprocess(self, item: str, features: list[Feature], opts: dict) -> object:
        if item == "bad":
            raise PipelineInputError("not a good item")
        return {"label": item}


def test_item_error_renders_with_its_position():
    error = ItemError("text is empty or only whitespace", "PipelineInputError")
    assert error.to_dict(3) == {"error": "input 3: text is empty or only whitespace",
                                "error_type": "PipelineInputError", "index": 3}
    assert ItemError.render([{"label": "a"}, error]) == [{"label": "a"}, error.to_dict(1)]


def test_cli_predict_lines_carry_the_index(monkeypatch):
    from typer.testing import CliRunner

    from hfport import cli
    from hfport.cli import app

    monkeypatch.setattr(cli, "pipeline", lambda task, model, **kw: FakePipe())  # the name the CLI calls
    result = CliRunner().invoke(app, ["predict", "some-model", "--task", "text-classification", "good", "bad"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines == [{"label": "good"},
                     {"error": "input 1: not a good item", "error_type": "PipelineInputError", "index": 1}]


def test_http_predict_gives_each_request_its_own_indices(tmp_path):
    """Two requests merged into one pipeline call: each response numbers its items from 0, and the merged call's
    positions never show (the old code rewrote messages by string replacement to get this)."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    settings = Settings(data_dir=tmp_path / "data", batch_max_wait_ms=1000)
    app = create_app(settings, run_worker=False)
    pipe = FakePipe()
    with TestClient(app) as client:
        app.state.store.register_model("fake", str(tmp_path), "text-classification")
        app.state.model_service.cache.get = lambda record: pipe
        bodies = {"a": ["good-a", "bad"], "b": ["bad", "good-b"]}
        answers: dict[str, object] = {}

        def call(name: str) -> None:
            answers[name] = client.post("/predict", json={"model": "fake", "inputs": bodies[name]}).json()

        threads = [threading.Thread(target=call, args=(name,)) for name in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [len(c) for c in pipe.calls] == [4], pipe.calls  # one forward pass of both requests' rows
        assert answers["a"]["outputs"] == [
            {"label": "good-a"}, {"error": "input 1: not a good item", "error_type": "PipelineInputError", "index": 1}]
        assert answers["b"]["outputs"] == [
            {"error": "input 0: not a good item", "error_type": "PipelineInputError", "index": 0}, {"label": "good-b"}]
        single = client.post("/predict", json={"model": "fake", "inputs": "bad"})
        assert single.status_code == 422
        assert single.json() == {"error": "input 0: not a good item", "error_type": "PipelineInputError"}


# --- layering ---------------------------------------------------------------------------------------------------


def test_the_code_parses_as_the_oldest_python_it_declares():
    """pyproject's requires-python is the oldest Python hfport installs on, but the suite runs on the newer one here,
    whose parser takes syntax the oldest rejects (X[a, *b] is 3.11's: import hfport failed on 3.10). ruff parses
    every file as that version; library calls new in later versions are not checked here."""
    import tomllib

    oldest = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"].removeprefix(">=")
    target = "py" + oldest.replace(".", "")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "E9",
                           "--target-version", target, "--output-format", "concise", "hfport", "server", "scripts",
                           "examples"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_library_never_imports_the_server():
    code = ("import sys, hfport, hfport.cli, hfport.train, hfport.export, hfport.rundir, hfport.pipelines; "
            "bad = sorted(m for m in sys.modules if m == 'server' or m.startswith('server.')); "
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_start_up_imports_no_compiler():
    """Importing hfport, its CLI and the service loads no torch._dynamo (about a second of CPU in every server, CLI
    call and job process; torch.nn.attention.varlen, which imports it, loads on the first packed attention on CUDA).
    The varlen kernel is still there when asked for."""
    code = ("import sys, hfport, hfport.cli, server.app; assert 'torch._dynamo' not in sys.modules; "
            "from hfport.nn import varlen; import torch; "
            "new = tuple(map(int, torch.__version__.split('.')[:2])) >= (2, 10); "
            "assert (varlen.VARLEN_ATTN is not None) == new, torch.__version__; "
            "assert 'torch._dynamo' in sys.modules and varlen.varlen_kernel() is varlen.VARLEN_ATTN")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _public_names(module: str) -> set[str]:
    import importlib

    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    return set(names) if names is not None else {n for n in vars(mod) if not n.startswith("_")}


def test_the_server_uses_only_hfports_public_api():
    public = {m: _public_names(m) for m in PUBLIC_MODULES}
    problems = []
    files = sorted((REPO / "server").rglob("*.py"))
    assert files
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        aliases = set()  # local names bound to the hfport package itself
        for node in ast.walk(tree):
            where = f"{path.relative_to(REPO)}:{node.lineno}" if hasattr(node, "lineno") else str(path)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "hfport":
                if node.module not in public:
                    problems.append(f"{where}: from {node.module} import ... (not a public module)")
                    continue
                problems += [f"{where}: {node.module}.{a.name} is not public" for a in node.names
                             if a.name not in public[node.module]]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] != "hfport":
                        continue
                    if a.name not in public:
                        problems.append(f"{where}: import {a.name} (not a public module)")
                    elif a.name == "hfport":
                        aliases.add(a.asname or "hfport")
        for node in ast.walk(tree):  # hfport.X through `import hfport`
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                if node.attr not in public["hfport"]:
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: hfport.{node.attr} is not public")
    assert not problems, "\n".join(problems)


def test_routes_import_no_route_and_the_server_shares_no_private_names():
    """One serving core (server/serving): a route imports it (and the protocol modules), never another route; no
    server module reaches for another's private name (`from x import _y`, `module._y`)."""
    problems = []
    for path in sorted((REPO / "server").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(REPO)
        modules = set()  # local names bound to server modules
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or (node.level == 0 and not (node.module or "").startswith(
                    "server")):
                continue
            module = node.module or ""
            route_import = (path.parent.name == "routes" and node.level == 1) or (
                module == "routes" or module.startswith("routes.") or module.startswith("server.routes"))
            if route_import and path.parent.name == "routes":
                problems.append(f"{where}:{node.lineno}: a route imports a route ({'.' * node.level}{module})")
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    problems.append(f"{where}:{node.lineno}: imports the private name {a.name}")
                modules.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                problems.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr} is another module's private name")
    assert not problems, "\n".join(problems)


# --- floors: imports only point down ----------------------------------------------------------------------------

# hfport's floors, lowest first. A module may import from its own floor and the floors below; nothing imports from a
# floor above it, at module level or inside a function, and no import circle (also not across function-level
# imports) exists. The longest matching prefix names a module's floor.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("hfport.errors", "hfport.version", "hfport.keymap", "hfport.hardware", "hfport.verbosity",
              "hfport.outputs", "hfport.settings")),  # settings: the library's HFPORT_* settings, read by any floor
    ("core", ("hfport.config", "hfport.hub", "hfport.nn", "hfport.staging")),  # nn/: the blocks and the LoRA layer
    ("formats", ("hfport.formats", "hfport.rundir")),  # the on-disk formats (adapter, sentence-transformers, ONNX, run)
    ("families", ("hfport.registry", "hfport.models", "hfport.heads", "hfport.tokenizer")),
    ("modeling", ("hfport.modeling", "hfport.inference")),
    ("tasks", ("hfport.tasks", "hfport.lora", "hfport.convert")),
    ("pipelines", ("hfport.pipelines", "hfport.embeddings", "hfport.agreement", "hfport.probes",
                   "hfport.int8", "hfport.int8_verdicts", "hfport.retrieval")),  # retrieval: embedding search,
    # hard-negative mining; int8_verdicts: the int8 gate's verdicts kept on disk
    ("train/export", ("hfport.train", "hfport.export", "hfport.evaluation")),  # evaluation: `hfport evaluate`
    ("entry", ("hfport.cli", "hfport.__main__", "hfport")),
)
# what a function may import: optional extras (hfport imports without them) and these, each with its reason
OPTIONAL_EXTRAS = {"onnxruntime", "onnx", "peft", "psycopg", "transformers", "sentence_transformers",
                   "mlflow",  # mlflow: report_to mlflow (hfport[trackers]) points its tracking URI at the run
                   "pyarrow",  # pyarrow: the `data` extra, read only for Parquet/Arrow/datasets-folder training data
                   "faiss",  # faiss: the `faiss` extra, an optional index for searching very large corpora
                   "openvino", "nncf"}  # the `openvino` extra: the OpenVINO export and pipeline backend
FUNCTION_IMPORTS_ALLOWED = {
    ("hfport/cli.py", "server"): "the service is an application over the library: imported when `serve` runs (and "
                                 "when its --help lists the server's settings)",
    ("hfport/hub.py", "huggingface_hub"): "only for a repo id (not a folder); importing it costs every start-up",
    ("hfport/nn/varlen.py", "torch.nn.attention.varlen"): "only for packed attention on CUDA; it imports "
                                                          "torch._dynamo, a second of CPU at every start-up",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> list[tuple[str, str, Path, int, bool]]:
    """(module, imported module, file, line, inside a function) for every import of every hfport module, imports
    under `if TYPE_CHECKING:` left out (they never run). `from . import x` names the submodule x when there is one."""
    files = {_module_name(p): p for p in sorted((REPO / "hfport").rglob("*.py"))}
    out = []
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

        def visit(node: ast.AST, in_function: bool, module: str = module, path: Path = path,
                  package: list[str] = package) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.Import):
                    out.extend((module, a.name, path, child.lineno, inside) for a in child.names)
                elif isinstance(child, ast.ImportFrom):
                    base = (package[:len(package) - child.level + 1] if child.level else [])
                    target = ".".join(base + ([child.module] if child.module else []))
                    for a in child.names:
                        sub = f"{target}.{a.name}"
                        out.append((module, sub if sub in files else target, path, child.lineno, inside))
                visit(child, inside)

        visit(ast.parse(path.read_text(), str(path)), False)
    return out


def _floor(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    return best[0] if best else None


def _known(path: Path, target: str) -> bool:
    """A function-level import FUNCTION_IMPORTS_ALLOWED gives a reason for."""
    rel = str(path.relative_to(REPO))
    return any((rel, t) in FUNCTION_IMPORTS_ALLOWED for t in (target, target.split(".")[0]))


def test_every_hfport_module_has_a_floor():
    missing = sorted({m for m, *_ in _imports() if _floor(m) is None})
    assert not missing, f"modules with no floor in FLOORS (add them): {missing}"


def test_imports_only_point_down_a_floor():
    problems = []
    for module, target, path, line, _ in _imports():
        if target.split(".")[0] != "hfport" or _known(path, target):
            continue
        mine, theirs = _floor(module), _floor(target)
        if theirs is not None and mine is not None and theirs > mine:
            problems.append(f"{path.relative_to(REPO)}:{line}: {module} ({FLOORS[mine][0]}) imports {target} "
                            f"({FLOORS[theirs][0]}, a floor above)")
    assert not problems, "\n".join(problems)


def test_no_function_level_imports():
    """Inside hfport/, a function imports only an optional extra (hfport imports without it) or what
    FUNCTION_IMPORTS_ALLOWED lists with its reason: anything else hides a dependency (or a circle) from the reader."""
    problems = [f"{path.relative_to(REPO)}:{line}: {module} imports {target} inside a function"
                for module, target, path, line, inside in _imports()
                if inside and target.split(".")[0] not in OPTIONAL_EXTRAS and not _known(path, target)]
    assert not problems, "\n".join(problems)


def test_no_import_circles():
    """Tarjan's strongly connected components over every import (function-level ones too): none has two modules."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for module, target, path, line, _ in _imports():
        if target.startswith("hfport") and target != module:
            graph.setdefault(module, set()).add(target)
            where.setdefault((module, target), f"{path.relative_to(REPO)}:{line}")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    new = circles
    assert not new, "\n".join("circle: " + ", ".join(sorted(c)) + " (" + "; ".join(
        where[(a, b)] + f" {a} -> {b}" for a in sorted(c) for b in sorted(c) if (a, b) in where) + ")" for c in new)


def test_hfport_init_imports_in_any_order():
    """hfport/__init__.py's imports work in any order (no `noqa: I001` pinning one): the submodules it names,
    imported below a bare package in forward and in reverse order, each load whole."""
    init = REPO / "hfport" / "__init__.py"
    assert "noqa: I001" not in init.read_text()
    names = [target for module, target, *_ in _imports() if module == "hfport" and target.startswith("hfport.")]
    order = list(dict.fromkeys(names))
    code = ("import importlib, sys, types; pkg = types.ModuleType('hfport'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['hfport'] = pkg; [importlib.import_module(m) for m in sys.argv[2:]]")
    for sequence in (order, order[::-1]):
        done = subprocess.run([sys.executable, "-c", code, str(init.parent), *sequence], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"importing {sequence}: {done.stderr[-2000:]}"


# --- the tests themselves -----------------------------------------------------------------------------------------


def _test_module_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in `path` (function-level ones too) that names a test module: tests.test_*,
    by absolute or relative import, or a `test_*` name taken from the tests package."""
    package = ["tests"] if path.parent.name == "tests" else []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join((package[:len(package) - node.level + 1] if node.level else []) +
                            ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] if base == "tests" else [base]
        found += [(node.lineno, t) for t in targets
                  if t.startswith("tests.") and t.split(".")[1].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    """A test module stands alone: what several share (builders, data, servers, comparisons) lives in conftest.py's
    fixtures or a helper module of tests/ (tiny.py, tiny_tokenizers.py, parity.py, data.py, finetuning.py,
    serving.py, cluster.py, ...), never in another test module: importing one runs its module-level code and drags its
    fixtures along (a second copy of a session fixture is a second instance), and hides which file owns what.
    Helpers and scripts/ import no test module either."""
    files = sorted((REPO / "tests").glob("*.py")) + sorted((REPO / "scripts").glob("*.py"))
    problems = [f"{path.relative_to(REPO)}:{line}: imports {target}"
                for path in files for line, target in _test_module_imports(path)]
    assert not problems, "\n".join(problems)


LEVEL_AT_START = logging.getLogger("hfport").level  # as collection found it, before any test ran


def test_an_in_process_cli_call_configures_logging():
    """The first half of a pair: what `hfport ... -q` run through CliRunner does to the process's logging."""
    from hfport.cli import setup_logging

    setup_logging(quiet=True)
    assert logging.getLogger("hfport").level == logging.ERROR and verbosity._configured == "quiet"


def test_the_next_test_finds_logging_as_it_was():
    """The second half: conftest's _logging_as_found put it back (without it, every later test's caplog missed
    hfport's warnings: test_int8's auto-int8 fallback failed after test_mpnet_electra's CLI tests)."""
    assert logging.getLogger("hfport").level == LEVEL_AT_START and verbosity._configured is None


def test_every_test_runs_on_one_intra_op_thread():
    """conftest.py sets it for the session, so a file run alone runs as it does in the whole suite (this module sets
    no thread count of its own)."""
    assert torch.get_num_threads() == 1
