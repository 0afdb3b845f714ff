"""dtype="auto-int8" through hfport.pipeline(): every int8 path installed (hfport's engine, the onnx-int8 and
openvino-int8 exports, each behind its gate) is timed and the fastest serves, said and kept (export/int8_choice.py).

The exports and gates are real (a tiny random BERT); the timing is replaced where a test needs a given winner, since
which runtime is faster on the test machine is what the choice measures, not what a test can fix."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("onnxruntime")
pytest.importorskip("openvino")
pytest.importorskip("nncf")

import hfport  # noqa: E402
from hfport.cli import app  # noqa: E402
from hfport.errors import ExportError  # noqa: E402
from hfport import probes  # noqa: E402
from hfport.export import int8_choice  # noqa: E402
from hfport.nn.int8 import Int8Linear  # noqa: E402
from hfport.pipelines.onnx_backend import OnnxModel  # noqa: E402
from hfport.pipelines.openvino_backend import OpenVinoModel  # noqa: E402
from tests.forked import start_child  # noqa: E402
from tests.parity import TEXTS  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def tiny(tiny_bert) -> Path:
    """conftest's session tiny BERT (read only: the exports go to the cache)."""
    return tiny_bert


def rates(monkeypatch, by_type: dict[type, float], seen: list | None = None,
          one_text: dict[type, float] | None = None) -> None:
    """texts_per_second answers by the pipeline's model type, and one_text_ms by ONE_TEXT's (default: 1 ms for every
    path, so the batches decide); the choice's input fixed, the pipelines real."""
    def pick(table, pipe):
        return next(value for kind, value in table.items() if isinstance(pipe.model, kind))

    def fixed(pipe, texts, passes=int8_choice.MEASURE_PASSES):
        if seen is not None:
            seen.append(type(pipe.model))
        assert texts == int8_choice.measured_inputs(pipe)  # every path on the same texts
        return pick(by_type, pipe)

    def alone(pipe, texts, passes=int8_choice.MEASURE_PASSES, count=int8_choice.SINGLE_TEXTS):
        assert texts == int8_choice.measured_inputs(pipe)
        return pick(one_text or {object: 1.0}, pipe)
    monkeypatch.setattr(int8_choice, "texts_per_second", fixed)
    monkeypatch.setattr(int8_choice, "one_text_ms", alone)


def test_the_fastest_gated_path_serves_and_is_kept(tiny, fresh_verdicts, monkeypatch, caplog):
    seen: list = []
    rates(monkeypatch, {OpenVinoModel: 300.0, OnnxModel: 200.0, torch.nn.Module: 100.0}, seen)
    with caplog.at_level("INFO", logger="hfport"):
        pipe = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8")
    assert isinstance(pipe.model, OpenVinoModel)
    assert "auto-int8 chose openvino (texts/s in batches / one text: openvino 300 / 1.0 ms, onnx 200 / 1.0 ms" \
        in caplog.text
    assert pipe.model.load_report.notes[-1].startswith("auto-int8 chose openvino")
    assert {OpenVinoModel, OnnxModel} <= set(seen)  # both graphs passed their gates and were timed
    kept = next((fresh_verdicts / int8_choice.FOLDER).glob(f"*/{int8_choice.CHOICE_FILE}"))
    choice = json.loads(kept.read_text())
    assert choice["path"] == "openvino" and Path(choice["folder"]).name == "openvino-int8"
    # what it serves is the verified export: the same outputs as the folder opened directly
    direct = hfport.pipeline("feature-extraction", model=choice["folder"])
    torch.testing.assert_close(torch.tensor(pipe(TEXTS[:3])[0]), torch.tensor(direct(TEXTS[:3])[0]))

    # a second load reads the kept choice: nothing exported, nothing timed
    def no(*args, **kwargs):
        raise AssertionError("the kept choice was not used")
    monkeypatch.setattr(int8_choice, "texts_per_second", no)
    monkeypatch.setattr(int8_choice, "one_text_ms", no)
    monkeypatch.setattr(int8_choice, "export", no)
    again = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8")
    assert isinstance(again.model, OpenVinoModel) and again.model.path.parent == Path(choice["folder"])

    # int8_paths narrows the choice: hfport's engine only, as the server asks
    torch_only = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8", int8_paths=("torch",))
    assert isinstance(torch_only.model, hfport.PreTrainedEncoder)


def test_a_refused_path_is_said_and_left_out(tiny, fresh_verdicts, monkeypatch):
    real = int8_choice.export

    def onnx_refused(src, out, *, format, **options):
        if format == "onnx-int8":
            raise ExportError(f"{out}: int8 vs fp32 texts/min cosine 0.5 fails min cosine >= 0.98")
        return real(src, out, format=format, **options)

    monkeypatch.setattr(int8_choice, "export", onnx_refused)
    rates(monkeypatch, {OpenVinoModel: 100.0, torch.nn.Module: 150.0})
    pipe = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8")
    line = pipe.model.load_report.notes[-1]
    if isinstance(pipe.model, OpenVinoModel):  # hfport's own gate refused int8 on this random model
        assert line.startswith("auto-int8 chose openvino") and "torch: " in line
    else:
        assert isinstance(pipe.model, hfport.PreTrainedEncoder) and line.startswith("auto-int8 chose torch")
    assert "refused onnx: " in line and "min cosine 0.5" in line


def test_when_graphs_are_not_weighed(tiny, monkeypatch):
    """Another task's head, adapters or a base model, a GPU, or torch alone: from_pretrained's auto-int8, no export."""
    def no(*args, **kwargs):
        raise AssertionError("graphs weighed")
    monkeypatch.setattr(hfport.pipelines, "INT8_CHOOSER", no)
    text = hfport.tasks.get("text-classification")
    feature = hfport.tasks.get("feature-extraction")
    weighs = hfport.pipelines._weighs_graphs
    assert not weighs(text, tiny, None, None, None, None)  # the folder's head is another task's
    assert not weighs(feature, tiny, torch.device("cuda"), None, None, None)
    assert not weighs(feature, tiny, None, None, {"a": "x"}, None)
    assert not weighs(feature, tiny, None, "base", None, None)
    assert not weighs(feature, tiny, None, None, None, ("torch",))
    assert weighs(feature, tiny, torch.device("cpu"), None, None, ("torch", "onnx"))
    assert weighs(feature, tiny, None, None, None, ("tensorrt",))  # choose() names the unknown path
    with pytest.raises(ValueError, match="int8_paths \\['tensorrt'\\]"):
        int8_choice.choose(tiny, "feature-extraction", load_torch=no, open_graph=no, make_pipeline=no,
                           paths=("tensorrt",))
    pipe = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8", int8_paths=["torch"])
    assert isinstance(pipe.model, hfport.PreTrainedEncoder)


def test_the_paths_are_timed_on_the_users_texts_or_the_gates_short_ones(tiny, fresh_verdicts, monkeypatch, tmp_path):
    """The built-in timing texts: the gate's short texts and passages; with gate data, its texts within the
    pipeline's input limit are what every path is timed on; a text that fails is refused, never timed as nothing."""
    pipe = hfport.pipeline("feature-extraction", model=tiny)
    limit = pipe.max_positions
    assert int8_choice.measured_inputs(pipe) == probes.judged_texts() + [p for _, p in probes.judged_pairs()]
    gate = tmp_path / "gate.txt"
    lines = [f"a text of the user's own, number {i}" for i in range(probes.MIN_JUDGED)]
    gate.write_text("\n".join(lines + ["word " * (limit + 10)]))  # the last: past the limit, left out
    timed: list[list[str]] = []
    monkeypatch.setattr(int8_choice, "texts_per_second", lambda pipe, texts, passes=3: timed.append(texts) or 100.0)
    monkeypatch.setattr(int8_choice, "one_text_ms", lambda pipe, texts, **kw: timed.append(texts) or 2.0)
    choice, served = int8_choice.choose(tiny, "feature-extraction", load_torch=lambda: "engine", open_graph=None,
                                        make_pipeline=lambda model: pipe, gate_data=gate, paths=("torch",))
    assert timed == [lines, lines] and (choice.path, served) == ("torch", "engine")
    many = tmp_path / "many.txt"  # more than are timed: an even sample of them
    many.write_text("\n".join(f"text number {i} of many" for i in range(int8_choice.MAX_MEASURED + 100)))
    sample = int8_choice.measured_inputs(pipe, many)
    assert len(sample) == (int8_choice.MAX_MEASURED + 100 + 1) // 2 <= int8_choice.MAX_MEASURED
    assert sample[:2] == ["text number 0 of many", "text number 2 of many"]
    too_long = tmp_path / "long.txt"
    too_long.write_text("\n".join(["word " * (limit + 10)] * probes.MIN_JUDGED))
    assert int8_choice.measured_inputs(pipe, too_long) == int8_choice.measured_inputs(pipe)  # none fits: built-in
    monkeypatch.undo()
    with pytest.raises(ExportError, match="1 of the 2 timed inputs failed .* cannot be timed on them"):
        int8_choice.texts_per_second(pipe, ["fine", "word " * (limit + 10)])


def test_each_task_is_timed_on_its_own_inputs(tiny, minilm_path, tmp_path):
    """The timing inputs are the task's (Pipeline.sample_inputs), every one answered: question-answering's are the
    pairs as questions and contexts, fill-mask's texts carry a mask token; plain texts would fail each of them."""
    from tests.tiny import decisive_qa, save_with_tokenizer

    for task, head in (("question-answering", "question-answering"), ("fill-mask", "masked-lm"),
                       ("token-classification", "token-classification")):
        folder = tmp_path / head
        model = save_with_tokenizer("bert", head, folder, minilm_path, vocab_size=30522)
        if head == "question-answering":
            decisive_qa(model, folder)
        pipe = hfport.pipeline(task, model=folder)
        inputs = int8_choice.measured_inputs(pipe)
        assert inputs == pipe.sample_inputs(probes.judged_texts(), probes.judged_pairs())
        answers = pipe.predict(inputs[:8])
        assert not [a for a in answers if isinstance(a, hfport.ItemError)], answers
        if task == "question-answering":
            assert inputs[0] == dict(zip(("question", "context"), probes.judged_pairs()[0]))
        elif task == "fill-mask":
            assert all(pipe.tokenizer.mask_token in text for text in inputs)
        assert int8_choice.one_text_ms(pipe, inputs, passes=1, count=2) > 0
        assert int8_choice.texts_per_second(pipe, inputs[:8], passes=1) > 0


def test_auto_int8_on_question_answering(tiny, fresh_verdicts, minilm_path, tmp_path):
    """auto-int8 weighs the graph paths for a question-answering folder, timed on questions with contexts (plain
    texts failed every one: 'needs a dict with keys question and context'), and serves the one chosen."""
    from tests.tiny import decisive_qa, save_with_tokenizer

    folder = tmp_path / "qa"
    decisive_qa(save_with_tokenizer("bert", "question-answering", folder, minilm_path, vocab_size=30522), folder)
    pipe = hfport.pipeline("question-answering", model=folder, dtype="auto-int8", int8_paths=("torch", "onnx"))
    assert pipe.model.load_report.notes[-1].startswith("auto-int8 chose "), pipe.model.load_report.notes
    kept = json.loads(next((fresh_verdicts / int8_choice.FOLDER).glob(f"*/{int8_choice.CHOICE_FILE}")).read_text())
    assert set(kept["measured"]) | set(kept["refused"]) == {"torch", "onnx"} and kept["measured"], kept
    answer = pipe(question="Who went home?", context="Anna went home after the long meeting.")
    assert {"answer", "score", "start", "end"} <= set(answer)


def test_a_refused_verify_says_which_rows_failed():
    """A graph export refused by its verify is kept with its failed rows, not only "the export does not match"."""
    from hfport.export.report import VerifyFailed, VerifyReport

    report = VerifyReport("out", "src")
    report.add("format", "model.onnx", True)
    for kind, value in (("texts", 0.55), ("pairs", 0.01), ("long texts", 0.04), ("long pairs", -0.09)):
        report.add("int8 vs fp32", f"{kind}/Spearman {value}", False, tolerance="Spearman >= 0.99")
    error = VerifyFailed("out: the ONNX export does not match src; nothing was written\n" + report.table(), report)
    assert int8_choice.refusal(error) == (
        "out: the ONNX export does not match src; nothing was written (failed: int8 vs fp32 texts/Spearman 0.55, "
        "Spearman >= 0.99; int8 vs fp32 pairs/Spearman 0.01, Spearman >= 0.99; int8 vs fp32 long texts/Spearman "
        "0.04, Spearman >= 0.99; 1 more)")
    assert int8_choice.refusal(ExportError("x: refused by its gate\nmore")) == "x: refused by its gate"


def test_bad_gate_data_is_named_before_anything_is_exported(tiny, fresh_verdicts, monkeypatch, tmp_path):
    """A gate data file that cannot be read fails the load at once, naming it: no path is exported or timed and no
    choice is kept (each path refused it before, one by one, after its export)."""
    def no(*args, **kwargs):
        raise AssertionError("exported or timed")
    monkeypatch.setattr(int8_choice, "export", no)
    monkeypatch.setattr(int8_choice, "texts_per_second", no)
    with pytest.raises(ExportError, match="gate data .*missing.txt: cannot read it"):
        hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8", gate_data=tmp_path / "missing.txt")
    assert not list((fresh_verdicts / int8_choice.FOLDER).glob(f"*/{int8_choice.CHOICE_FILE}"))


def test_a_kept_choice_whose_folder_is_gone_is_made_again(tmp_path):
    where = tmp_path / "key"
    where.mkdir()
    (where / int8_choice.CHOICE_FILE).write_text(json.dumps(
        {"path": "openvino", "folder": str(tmp_path / "gone"), "measured": {"openvino": 1.0}, "refused": {}}))
    assert int8_choice.read_choice(where) is None
    (where / int8_choice.CHOICE_FILE).write_text("{not json")
    assert int8_choice.read_choice(where) is None
    (where / int8_choice.CHOICE_FILE).write_text(json.dumps({"path": "torch", "folder": None, "measured": {}}))
    assert int8_choice.read_choice(where).path == "torch"


def test_nothing_passing_falls_back_to_the_models_auto_int8(tiny, fresh_verdicts, monkeypatch):
    """Every path weighed is refused: the choice says so (kept, with each reason) and from_pretrained's auto-int8
    serves (hfport's engine: int8 where its own gate passes, else bf16)."""
    def refused(src, out, *, format, **options):
        raise ExportError(f"{out}: {format} refused by its gate")

    monkeypatch.setattr(int8_choice, "export", refused)
    pipe = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8", int8_paths=("onnx", "openvino"))
    assert isinstance(pipe.model, hfport.PreTrainedEncoder)
    kept = json.loads(next((fresh_verdicts / int8_choice.FOLDER).glob(f"*/{int8_choice.CHOICE_FILE}")).read_text())
    assert kept["path"] is None and kept["folder"] is None and set(kept["refused"]) == {"onnx", "openvino"}
    assert int8_choice.Int8Choice(**kept).line().startswith("auto-int8: no int8 path passed its gate; refused onnx: ")


def no_second_choice(monkeypatch) -> None:
    """From here on, nothing may export or time: a load must read the kept choice."""
    def no(*args, **kwargs):
        raise AssertionError("the kept choice was not used")
    monkeypatch.setattr(int8_choice, "texts_per_second", no)
    monkeypatch.setattr(int8_choice, "one_text_ms", no)
    monkeypatch.setattr(int8_choice, "export", no)


def test_a_kept_torch_choice_serves_hfports_int8_engine(tiny, fresh_verdicts, monkeypatch):
    """hfport's engine wins and is kept: the next load reads the choice and loads the int8 model again (no export, no
    timing), with the same outputs."""
    rates(monkeypatch, {OnnxModel: 100.0, torch.nn.Module: 300.0})
    first = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8", int8_paths=("torch", "onnx"))
    assert first.model.load_report.notes[-1].startswith(
        "auto-int8 chose torch (texts/s in batches / one text: torch 300 / 1.0 ms, onnx 100 / 1.0 ms")
    kept = json.loads(next((fresh_verdicts / int8_choice.FOLDER).glob(f"*/{int8_choice.CHOICE_FILE}")).read_text())
    assert kept["path"] == "torch" and kept["folder"] is None and set(kept["measured"]) == {"torch", "onnx"}

    no_second_choice(monkeypatch)
    again = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8", int8_paths=("torch", "onnx"))
    assert isinstance(again.model, hfport.PreTrainedEncoder) and again.model is not first.model
    assert sum(isinstance(m, Int8Linear) for m in again.model.modules()) == 12  # 2 layers x (q, k, v, o, up, down)
    assert again.model.load_report.notes[-1] == first.model.load_report.notes[-1]
    for a, b in zip(first(TEXTS[:4]), again(TEXTS[:4])):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=0, atol=0)


def test_one_text_alone_counts_as_much_as_batches(tiny, fresh_verdicts, monkeypatch):
    """The winner is the best geometric mean of the two speeds: ONNX 1.5x as fast in batches loses to hfport's engine
    4x as fast on one text (sqrt(200 * 1000 / 1) > sqrt(300 * 1000 / 4)), and the line ranks them so."""
    rates(monkeypatch, {OnnxModel: 300.0, torch.nn.Module: 200.0}, one_text={OnnxModel: 4.0, torch.nn.Module: 1.0})
    pipe = hfport.pipeline("feature-extraction", model=tiny, dtype="auto-int8", int8_paths=("torch", "onnx"))
    assert isinstance(pipe.model, hfport.PreTrainedEncoder)
    assert pipe.model.load_report.notes[-1].startswith(
        "auto-int8 chose torch (texts/s in batches / one text: torch 200 / 1.0 ms, onnx 300 / 4.0 ms)")
    kept = json.loads(next((fresh_verdicts / int8_choice.FOLDER).glob(f"*/{int8_choice.CHOICE_FILE}")).read_text())
    assert kept["one_text_ms"] == {"torch": 1.0, "onnx": 4.0} and kept["measured"] == {"torch": 200.0, "onnx": 300.0}
    choice = int8_choice.Int8Choice("onnx", measured={"a": 300.0, "b": 200.0}, one_text_ms={"a": 1.4, "b": 1.0})
    assert choice.score("a") > choice.score("b")  # 300 * 1000 / 1.4 > 200 * 1000 / 1.0


def test_one_text_ms_times_each_text_alone():
    """one_text_ms calls the pipeline with one text at a time, COUNT texts, each warmed up and then PASSES times."""
    calls: list[list[str]] = []
    fake = SimpleNamespace(predict=lambda texts: calls.append(list(texts)) or [[0.0] for _ in texts])
    texts = [f"text {i}" for i in range(20)]
    ms = int8_choice.one_text_ms(fake, texts, passes=2, count=5)
    assert ms > 0 and calls == [[t] for t in texts[:5] for _ in range(3)]


def test_cli_predict_auto_int8(tiny, fresh_verdicts, monkeypatch):
    """`hfport predict --dtype auto-int8`: the answers of the path chosen, the choice in the log (-v: info, as
    pipeline() logs it), and a second run reads the kept choice."""
    rates(monkeypatch, {OnnxModel: 300.0, OpenVinoModel: 200.0, torch.nn.Module: 100.0})

    def predict(*args: str):
        run = CliRunner().invoke(app, ["predict", str(tiny), *TEXTS[:2], "-t", "feature-extraction",
                                       "--dtype", "auto-int8", *args])
        assert run.exit_code == 0, run.output
        return [json.loads(line) for line in run.stdout.splitlines()], run.stderr

    answers, said = predict("-v")
    assert "auto-int8 chose onnx (texts/s in batches / one text: onnx 300 / 1.0 ms, openvino 200" in said
    assert "auto-int8: exporting and gating the int8 paths" in said  # the progress bar of the first, long load
    kept = json.loads(next((fresh_verdicts / int8_choice.FOLDER).glob(f"*/{int8_choice.CHOICE_FILE}")).read_text())
    assert kept["path"] == "onnx"
    direct = hfport.pipeline("feature-extraction", model=kept["folder"])
    assert len(answers) == 2
    for got, want in zip(answers, direct(TEXTS[:2])):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))

    no_second_choice(monkeypatch)
    again, said = predict("-v")
    assert "auto-int8 chose onnx (texts/s in batches / one text: onnx 300 / 1.0 ms, openvino 200" in said
    assert "(kept in " in said
    assert "exporting and gating" not in said
    assert again == answers
    quiet, said = predict()  # the default verbosity: warnings only
    assert quiet == answers and said == ""


def choose_in_child(folder: Path, fastest: str, out: Path) -> None:
    """A process's auto-int8 load, its own timing saying FASTEST wins; its answers, its note and whether it timed the
    paths written to OUT."""
    torch.set_num_threads(1)
    timed: list[str] = []

    def fixed(pipe, texts, passes=int8_choice.MEASURE_PASSES):
        timed.append(type(pipe.model).__name__)
        return 300.0 if isinstance(pipe.model, OnnxModel) == (fastest == "onnx") else 100.0

    int8_choice.texts_per_second = fixed  # this child's own module: nothing to restore
    int8_choice.one_text_ms = lambda pipe, texts, **kw: 1.0
    pipe = hfport.pipeline("feature-extraction", model=folder, dtype="auto-int8", int8_paths=("torch", "onnx"))
    out.write_text(json.dumps({"note": pipe.model.load_report.notes[-1], "timed": timed, "answers": pipe(TEXTS[:3])}))


def test_two_processes_making_the_same_choice_at_once(tiny, fresh_verdicts, monkeypatch, tmp_path):
    """Two processes load the same folder with auto-int8 at once, over one cache (HFPORT_CACHE_DIR). Their
    measurements disagree (each child's timing names another winner: under each other's load two processes' figures
    differ, as runs on this machine showed), yet one choice is made and kept, both serve it with equal answers, and no
    staging folder is left."""
    hfport.hardware.cpu_capabilities()  # measured once here (into the test's cache), not by both children
    monkeypatch.setenv("HFPORT_CACHE_DIR", str(fresh_verdicts))
    outs = [tmp_path / "onnx.json", tmp_path / "torch.json"]
    children = [start_child(choose_in_child, tiny, fastest, out) for fastest, out in zip(("onnx", "torch"), outs)]
    for child in children:
        child.join(120)
    assert [child.exitcode for child in children] == [0, 0]
    loads = [json.loads(out.read_text()) for out in outs]

    root = fresh_verdicts / int8_choice.FOLDER
    kept = list(root.glob(f"*/{int8_choice.CHOICE_FILE}"))
    assert len(kept) == 1
    choice = int8_choice.read_choice(kept[0].parent)
    assert choice is not None and choice.path in ("onnx", "torch")
    assert [load["note"] for load in loads] == [choice.line()] * 2
    assert sum(bool(load["timed"]) for load in loads) == 1  # the other read the choice made
    assert loads[0]["answers"] == loads[1]["answers"]
    assert not [p for p in root.rglob(".*") if p.name.endswith((".tmp", ".old"))]  # no staging folder or file left
