"""OpenVINO export (formats openvino and openvino-int8), its fail-closed verify, and the OpenVINO pipeline backend.

Every BERT head -> openvino_model.xml + openvino_model_qint8_quantized.xml -> verify passes (the fp32 IR against
hfport and transformers at 1e-5 with the f32 precision hint, the int8 IR through the int8 gate) -> OpenVINO's own
runtime (openvino.Core, compiled here) computes hfport's torch outputs from the fp32 IR -> the pipelines serve the
folder as the runtime computes it. Then what must fail: a damaged int8 IR (nothing written), a changed weight file,
gate data too small to judge, a missing `openvino` extra; and the backend's choices (detection, file=, dtype).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

ov = pytest.importorskip("openvino")  # the `openvino` extra is part of `dev`; without it only the error tests apply
pytest.importorskip("nncf")
pytest.importorskip("onnx")

import hfport  # noqa: E402
from hfport.cli import app  # noqa: E402
from hfport.export import FORMATS, ExportError, VerifyFailed, detect_format, verify  # noqa: E402
from hfport.export import openvino as ov_export  # noqa: E402
from hfport.export.openvino import export_openvino  # noqa: E402
from hfport.formats.openvino import (IR_FILE, MANIFEST, QUANTIZED_IR_FILE, OpenVinoModelError,  # noqa: E402
                                     default_file, is_openvino_model, read_manifest, served_precision)
from hfport.formats.sentence_transformers import write_embedding_layout  # noqa: E402
from hfport.pipelines.openvino_backend import OpenVinoModel  # noqa: E402
from hfport.tasks import canonical  # noqa: E402
from tests.parity import GRAPH_PIPELINE_CASES, TEXTS, assert_same  # noqa: E402
from tests.tiny import HEADS, decisive_qa, save_with_tokenizer  # noqa: E402

torch.set_num_threads(1)  # tiny models on shared cores: threads only add overhead

TASKS = [canonical(task) for task in HEADS]  # the pipeline tags
BF16_CPU = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")  # OpenVINO computes bf16 here
# as tests/test_onnx.py: a random tiny MLM's logits over 30522 tokens are near-uniform, so its ranks 5 and 6 are near
# ties that int8 noise swaps (top-1 unchanged); every other head is held to the default 0.99
MIN_AGREEMENT = {task: 0.99 for task in TASKS} | {"fill-mask": 0.9}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("openvino")


@pytest.fixture(scope="module")
def source(root, minilm_path):
    """task -> a tiny random BERT with MiniLM's tokenizer (built once); feature-extraction in the
    sentence-transformers layout (cls pooling, normalized: not what a folder without the files gets)."""
    made: dict[str, Path] = {}

    def get(task: str) -> Path:
        if task not in made:
            folder = root / "src" / task
            model = save_with_tokenizer("bert", task, folder, minilm_path, vocab_size=30522)
            if task == "question-answering":
                decisive_qa(model, folder)
            if task == "feature-extraction":
                write_embedding_layout(folder, pooling="cls", normalize=True, hidden_size=model.config.hidden_size,
                                       max_seq_length=128)
            made[task] = folder
        return made[task]

    return get


@pytest.fixture(scope="module")
def exported(root, source):
    """task -> (the verified openvino-int8 folder, its report), exported once."""
    made: dict[str, tuple[Path, hfport.VerifyReport]] = {}

    def get(task: str) -> tuple[Path, hfport.VerifyReport]:
        if task not in made:
            out = root / "ov" / task
            result = export_openvino(source(task), out, quantize="int8", min_agreement=MIN_AGREEMENT[task])
            made[task] = (out, result.report)
        return made[task]

    return get


def rows(report: hfport.VerifyReport, check: str) -> list:
    return [r for r in report.rows if r.check == check]


def no_leftovers(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def encode(folder: Path, texts: list[str]) -> dict[str, torch.Tensor]:
    return dict(hfport.AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="pt"))


def runtime(xml: Path, enc: dict[str, torch.Tensor], output: str, hint: str = "f32") -> torch.Tensor:
    """OpenVINO's own runtime on the IR: read, compiled with the precision hint, fed here (not hfport's backend)."""
    compiled = ov.Core().compile_model(ov.Core().read_model(str(xml)), "CPU", {"INFERENCE_PRECISION_HINT": hint})
    names = [i.get_any_name() for i in compiled.inputs]
    return torch.from_numpy(compiled({name: enc[name].numpy() for name in names})[output].copy())


# --- round trips --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
def test_every_head_exports_verifies_and_matches_torch_in_the_runtime(task, exported, source):
    out, report = exported(task)
    assert report.passed, report.table()
    assert {IR_FILE, "openvino_model.bin", QUANTIZED_IR_FILE, "openvino_model_qint8_quantized.bin", "config.json",
            "tokenizer.json", MANIFEST, "README.md"} <= {p.name for p in out.iterdir()}
    assert not list(out.glob("*.onnx"))  # the traced graph is the IRs' source, not part of the folder
    fp32 = rows(report, "fp32 vs hfport") + rows(report, "fp32 vs transformers")
    assert {r.check for r in fp32} == {"fp32 vs hfport", "fp32 vs transformers"}
    assert all(r.passed and r.max_abs_diff <= 1e-5 for r in fp32)
    assert rows(report, "int8 vs fp32") and all(r.passed for r in rows(report, "int8 vs fp32"))
    manifest = json.loads((out / MANIFEST).read_text())
    assert (manifest["format"], manifest["default_file"], manifest["inference_precision"]) == \
        ("openvino-int8", QUANTIZED_IR_FILE, "f32")
    # the int8 IR's own precision: bf16 where the gate passed it computed so (OpenVINO computes bf16 here), and then
    # verify judged it so too, the f32 rows' kinds again
    gate = [r.output.split("/")[0] for r in rows(report, "int8 vs fp32")]
    f32_rows = [name for name in gate if "(" not in name]
    if BF16_CPU and manifest["int8_precision"].startswith("bf16: passes"):
        assert manifest["inference_precisions"] == {QUANTIZED_IR_FILE: "bf16"}
        assert [name for name in gate if "(" in name] == [f"{name} (bf16)" for name in f32_rows]
    else:
        assert "inference_precisions" not in manifest and len(gate) == len(f32_rows), manifest["int8_precision"]
    assert set(manifest["sha256"]) == {IR_FILE, "openvino_model.bin", QUANTIZED_IR_FILE,
                                       "openvino_model_qint8_quantized.bin"}
    # attention is OpenVINO's one float op a layer (no activation MatMul left to keep); the head stays fp32
    # (export/openvino.py says why)
    kept = manifest["quantization"]["kept_fp32"]
    layers = json.loads((source(task) / "config.json").read_text())["num_hidden_layers"]
    types = [op.get_type_name() for op in ov.Core().read_model(str(out / QUANTIZED_IR_FILE)).get_ops()]
    assert types.count("ScaledDotProductAttention") == layers and not any("/attn/MatMul" in name for name in kept)
    assert any(name.startswith("/model/head/") for name in kept) == (task != "feature-extraction")
    # the fp32 IR in OpenVINO's own runtime with the f32 hint computes hfport's torch outputs at real positions
    model = hfport.AutoModel.from_pretrained(source(task)) if task == "feature-extraction" else \
        hfport.tasks.get(task).model_class.from_pretrained(source(task))
    enc = encode(out, TEXTS)
    with torch.inference_mode():
        want = model(enc["input_ids"], attention_mask=enc["attention_mask"], token_type_ids=enc["token_type_ids"])
    real = enc["attention_mask"].bool()  # (B, T)
    for name, (rank, _) in hfport.tasks.get(task).graph_outputs.items():
        got, ref = runtime(out / IR_FILE, enc, name), want[name]
        if rank == 3 or hfport.tasks.get(task).per_token(name):
            got, ref = got[real], ref[real]  # padding positions are outside the contract
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["modernbert", "deberta-v2", "mpnet", "albert", "eurobert"])
def test_other_families_fp32_ir_verifies(family, minilm_path, tmp_path):
    """The additive attention trace (export/openvino.py's TRACED_ATTENTION) on the families whose attention differs
    from BERT's (local windows and rotary, relative bias, shared layers, grouped keys): the fp32 IR equals hfport and
    transformers at 1e-5 (verify's rows)."""
    src = tmp_path / family
    save_with_tokenizer(family, "base", src, minilm_path, vocab_size=30522)
    report = export_openvino(src, tmp_path / "ov").report
    assert report.passed, report.table()
    assert {r.check for r in report.rows if r.check.startswith("fp32")} == {"fp32 vs hfport", "fp32 vs transformers"}


@pytest.mark.parametrize("family", ["albert", "deberta-v2"])
def test_other_families_int8_split_their_feed_forward(family, minilm_path, tmp_path, monkeypatch):
    """The int8 export where the feed-forward sits or traces otherwise than BERT's: ALBERT's in shared layer groups
    (traced under names without the groups), DeBERTa's linear layers traced as Gemm on its (N, C) rows. The
    feed-forward scope selects exactly the traced graph's feed-forward MatMuls (not none, which would skip to the next
    scope), the int8 IR written with it passes the gate, and the folder serves it. (The gated feed-forwards,
    ModernBERT's and EuroBERT's, trace as BERT's does: not repeated here, each export costs 7-9 s.)"""
    src = tmp_path / family
    save_with_tokenizer(family, "base", src, minilm_path, vocab_size=30522)
    traced: list[str] = []  # the traced graph's weight MatMuls, as quantize_ir reads them
    real = ov_export.weight_matmuls
    monkeypatch.setattr(ov_export, "weight_matmuls", lambda path: traced.extend(real(path)) or traced)
    out = tmp_path / "ov"
    report = export_openvino(src, out, quantize="int8").report
    assert report.passed and rows(report, "int8 vs fp32"), report.table()
    assert read_manifest(out)["quantization"]["outlier_scope"] == ov_export.OUTLIER_SCOPES[0].name
    in_scope = ov_export.OUTLIER_SCOPES[0].matmuls(hfport.AutoModel.from_pretrained(src))
    selected = [name for name in traced if in_scope(name)]
    assert selected and selected == [name for name in traced if "/ffn/" in name]  # EncoderLayer.ffn's, only
    pipe = hfport.pipeline("feature-extraction", model=out)
    assert pipe.model.path == out / QUANTIZED_IR_FILE and len(pipe(TEXTS[:2])) == 2


def test_task_without_a_graph_is_refused(minilm_path, tmp_path):
    """Multiple choice ((B, C, T) inputs) has no graph: refused before anything is written."""
    choice = tmp_path / "choice"
    save_with_tokenizer("bert", "multiple-choice", choice, minilm_path, vocab_size=30522)
    with pytest.raises(ExportError, match="no graph for multiple-choice"):
        export_openvino(choice, tmp_path / "mc", quantize="int8")
    no_leftovers(tmp_path / "mc")


def test_card_names_the_int8_ir_and_the_gate(exported):
    out, report = exported("text-classification")
    card = (out / "README.md").read_text()
    assert "`openvino_model_qint8_quantized.xml` is the int8 IR" in card and "INFERENCE_PRECISION_HINT" in card
    gate = rows(report, "int8 vs fp32")
    assert gate and all(f"| {r.output} | {r.shape} | {r.tolerance} | pass |" in card for r in gate)
    assert 'hfport.pipeline("text-classification", model="text-classification")' in card


PIPELINE_CASES = {"feature-extraction": ("sentence-embedding", TEXTS, {}), **GRAPH_PIPELINE_CASES}


@pytest.mark.parametrize("task", TASKS)
def test_pipelines_serve_the_folder(task, exported, source):
    """The folder (detected: no backend=) serves its int8 IR; file= its fp32 IR, which answers as the torch
    pipeline does."""
    out, _ = exported(task)
    pipe_task, inputs, options = PIPELINE_CASES[task]
    int8 = hfport.pipeline(pipe_task, model=out, **options)
    assert isinstance(int8.model, OpenVinoModel) and int8.model.path == out / QUANTIZED_IR_FILE
    assert len(int8(inputs)) == len(inputs)
    fp32 = hfport.pipeline(pipe_task, model=out, file=IR_FILE, **options)
    assert fp32.model.path == out / IR_FILE and fp32.model.precision == "f32"
    assert_same(hfport.pipeline(pipe_task, model=source(task), **options)(inputs), fp32(inputs), atol=1e-5)


def test_embedding_pipeline_equals_the_runtime(exported):
    """sentence-embedding on the int8 folder is OpenVINO's runtime on the int8 IR in the precision its manifest
    records, pooled as the source's sentence-transformers files say (cls, normalized), one text a call (unpadded, as
    the runtime call here)."""
    out, _ = exported("feature-extraction")
    pipe = hfport.pipeline("sentence-embedding", model=out)
    hint = served_precision(out, QUANTIZED_IR_FILE)
    assert pipe.model.precision == hint and hint == ("bf16" if BF16_CPU else "f32")
    for text in TEXTS:
        hidden = runtime(out / QUANTIZED_IR_FILE, encode(out, [text]), "last_hidden_state", hint)  # (1, T, C)
        want = torch.nn.functional.normalize(hidden[0, 0], dim=-1)  # the first token's state
        torch.testing.assert_close(torch.tensor(pipe(text)), want, atol=1e-6, rtol=1e-6)
    fp32_hidden = runtime(out / IR_FILE, encode(out, [TEXTS[0]]), "last_hidden_state")
    assert (torch.nn.functional.normalize(fp32_hidden[0, 0], dim=-1) - torch.tensor(pipe(TEXTS[0]))).abs().max() > 1e-4


def test_precision_follows_dtype(exported, source):
    """dtype None/auto: the hint the manifest records for the IR, which verify proved (the fp32 IR's f32, where
    OpenVINO's default on a bf16 CPU would be bf16; the int8 IR's bf16 where its gate passed it); float32: f32;
    bfloat16: bf16; anything else is refused naming what runs."""
    out, _ = exported("feature-extraction")
    for dtype in (None, "auto", "float32"):
        model = hfport.pipeline("feature-extraction", model=out, file=IR_FILE, dtype=dtype).model
        assert model.precision == "f32" and str(model.compiled.get_property("INFERENCE_PRECISION_HINT")) == "<Type: " \
            "'float32'>"
    for dtype in (None, "auto"):
        int8 = hfport.pipeline("feature-extraction", model=out, dtype=dtype).model
        assert int8.path.name == QUANTIZED_IR_FILE and int8.precision == served_precision(out, QUANTIZED_IR_FILE)
    assert hfport.pipeline("feature-extraction", model=out, dtype="float32").model.precision == "f32"
    bf16 = hfport.pipeline("feature-extraction", model=out, file=IR_FILE, dtype="bfloat16").model
    assert bf16.precision == "bf16"
    for dtype in ("float16", "int8"):
        with pytest.raises(ValueError, match="openvino backend runs float32 or bfloat16"):
            hfport.pipeline("feature-extraction", model=out, dtype=dtype)


def test_backend_choice_and_detection(exported, source, tmp_path):
    out, _ = exported("text-classification")
    assert is_openvino_model(out) and is_openvino_model(out / QUANTIZED_IR_FILE)
    assert not is_openvino_model(source("text-classification"))
    assert detect_format(out) is FORMATS["openvino-int8"]
    fp32_only = tmp_path / "fp32"
    export_openvino(source("text-classification"), fp32_only)
    assert detect_format(fp32_only) is FORMATS["openvino"] and not (fp32_only / QUANTIZED_IR_FILE).exists()
    assert hfport.pipeline("text-classification", model=fp32_only).model.path.name == IR_FILE
    with pytest.raises(ValueError, match=r"backend 'tensorrt': use one of \['torch', 'onnx', 'openvino'\]"):
        hfport.pipeline("text-classification", model=out, backend="tensorrt")
    with pytest.raises(ValueError, match="is a text-classification graph"):
        hfport.pipeline("token-classification", model=out)
    with pytest.raises(OpenVinoModelError, match="must name an .xml file"):
        hfport.pipeline("text-classification", model=out, file="../model.onnx")
    pipe = hfport.pipeline("text-classification", model=out / IR_FILE, backend="openvino")  # one IR file
    assert "model=bert" in repr(pipe) and pipe.model.path == out / IR_FILE and repr(pipe.model).endswith("f32)")
    size = sum((out / f).stat().st_size for f in (QUANTIZED_IR_FILE, "openvino_model_qint8_quantized.bin"))
    assert sum(t.numel() for t in hfport.pipeline("text-classification", model=out).model.buffers()) == size
    bad = pipe.predict(["fine", "", "great"])  # a bad item fails alone, as with the PyTorch backend
    assert isinstance(bad[1], hfport.ItemError) and bad[0]["label"] and bad[2]["label"]


def test_folder_rules_without_a_runtime(tmp_path):
    """formats/openvino.py's folder rules (formats/graph_folder.py's, with OpenVINO's names), word for word: an IR is
    an .xml with its .bin; a manifest without default_file serves openvino_model.xml even when it records a
    quantization (the pre-default_file rule is ONNX's only); file= and default_file name an .xml in the folder."""
    folder = tmp_path / "ir"
    folder.mkdir()
    (folder / IR_FILE).write_text("<net/>")
    assert not is_openvino_model(folder / IR_FILE)  # no .bin beside it
    (folder / "openvino_model.bin").write_bytes(b"")
    assert is_openvino_model(folder / IR_FILE) and is_openvino_model(folder)
    assert default_file(folder) == IR_FILE  # no manifest: optimum-intel's export
    (folder / MANIFEST).write_text(json.dumps({"quantization": {"type": "int8"}}))
    assert default_file(folder) == IR_FILE
    (folder / MANIFEST).write_text(json.dumps({"default_file": "../x.xml"}))
    with pytest.raises(OpenVinoModelError) as bad:
        default_file(folder)
    assert str(bad.value) == (f"{folder / MANIFEST}: default_file '../x.xml' must name an .xml file in the folder, "
                              f"e.g. '{IR_FILE}' or '{QUANTIZED_IR_FILE}'")
    (folder / MANIFEST).write_text("[]")
    with pytest.raises(OpenVinoModelError, match="the top level must be a JSON object"):
        read_manifest(folder)
    with pytest.raises(OpenVinoModelError) as bad:
        OpenVinoModel.from_pretrained(folder / IR_FILE, file=QUANTIZED_IR_FILE)
    assert str(bad.value) == (f"{folder / IR_FILE}: file='{QUANTIZED_IR_FILE}' picks an IR of an OpenVINO folder; "
                              f"{IR_FILE} is an IR already")
    with pytest.raises(OpenVinoModelError) as bad:
        OpenVinoModel.from_pretrained(tmp_path / "nowhere")
    assert str(bad.value) == f"{tmp_path / 'nowhere'}: no such OpenVINO folder or IR file"


# --- verify fails closed ------------------------------------------------------------------------------------


def damage_scales(xml: Path) -> None:
    """Every int8 weight's dequantization scale times 8 (the Multiply after each int8 constant's Convert), saved
    back in place."""
    core = ov.Core()
    model = core.read_model(str(xml))
    for op in model.get_ops():
        if op.get_type_name() != "Constant" or op.get_element_type() != ov.Type.i8:
            continue
        for convert in (t.get_node() for t in op.output(0).get_target_inputs()):
            for target in convert.output(0).get_target_inputs():
                mul = target.get_node()
                other = mul.input_value(1 - target.get_index()).get_node()
                if mul.get_type_name() == "Multiply" and other.get_type_name() == "Constant":
                    scaled = ov.opset13.constant(other.get_data() * 8)
                    mul.input(1 - target.get_index()).replace_source_output(scaled.output(0))
    tmp = xml.with_name("damaged.xml")
    ov.save_model(model, str(tmp), compress_to_fp16=False)
    del model
    tmp.replace(xml)
    tmp.with_suffix(".bin").replace(xml.with_suffix(".bin"))


def test_damaged_int8_ir_writes_nothing(source, tmp_path, monkeypatch):
    """A quantizer that damages the IR (every int8 weight's scale x8): the gate refuses it, the fp32 rows pass. (An
    embedding model: the tiny random classifiers' fp32 heads still pick the same labels from the damaged body.)"""
    real = ov_export.quantize_ir

    def damaging(ov_, nncf, traced, dst, *args):
        entry = real(ov_, nncf, traced, dst, *args)
        damage_scales(dst)
        return entry

    monkeypatch.setattr(ov_export, "quantize_ir", damaging)
    out = tmp_path / "out"
    with pytest.raises(VerifyFailed, match="nothing was written") as info:
        export_openvino(source("feature-extraction"), out, quantize="int8")
    assert rows(info.value.report, "int8 vs fp32") and all(
        r.check == "int8 vs fp32" for r in info.value.report.failures)
    no_leftovers(out)


def test_outlier_scopes_are_tried_until_the_gate_passes(source, tmp_path, monkeypatch, caplog):
    """The feed-forward scope first; an int8 IR the gate refuses is written again with the next scope (the manifest
    and the log say which)."""
    real = ov_export.quantize_ir
    tried = []

    def first_damaged(ov_, nncf, traced, dst, model, tok_folder, scope):
        tried.append(scope.name)
        entry = real(ov_, nncf, traced, dst, model, tok_folder, scope)
        if len(tried) == 1:
            damage_scales(dst)
        return entry

    monkeypatch.setattr(ov_export, "quantize_ir", first_damaged)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="hfport"):
        export_openvino(source("feature-extraction"), out, quantize="int8")
    assert tried == [scope.name for scope in ov_export.OUTLIER_SCOPES]
    assert read_manifest(out)["quantization"]["outlier_scope"] == ov_export.OUTLIER_SCOPES[-1].name
    assert "fails the int8 gate" in caplog.text


def test_a_failure_outside_the_gate_is_not_retried(source, tmp_path, monkeypatch):
    """Only the int8 gate's refusal sends the export to the next outlier scope: a damaged fp32 IR fails once."""
    real = ov_export.quantize_ir
    tried = []

    def fp32_damaged(ov_, nncf, traced, dst, *args):
        tried.append(1)
        entry = real(ov_, nncf, traced, dst, *args)
        weights = dst.with_name(IR_FILE).with_suffix(".bin")
        data = bytearray(weights.read_bytes())
        data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # the later half of the fp32 weights zeroed
        weights.write_bytes(bytes(data))
        return entry

    monkeypatch.setattr(ov_export, "quantize_ir", fp32_damaged)
    out = tmp_path / "out"
    with pytest.raises(VerifyFailed, match="nothing was written") as info:
        export_openvino(source("feature-extraction"), out, quantize="int8")
    assert tried == [1]
    assert {r.check for r in info.value.report.failures} - {"int8 vs fp32"}  # failed beyond the gate
    no_leftovers(out)


@pytest.mark.skipif(not BF16_CPU, reason="OpenVINO computes no bf16 on this CPU: the int8 IR's bf16 is not judged")
def test_int8_ir_whose_bf16_fails_the_gate_is_served_in_f32(source, tmp_path, monkeypatch):
    """An int8 IR whose bf16 computation moves the answers (noise added to what it returns in bf16): the export
    passes on the f32 gate, the manifest records f32 for it and says why, verify judges no bf16 rows, and the
    backend serves it in f32."""

    class NoisyInBf16(OpenVinoModel):
        def run(self, feeds):
            outs = super().run(feeds)
            if self.precision != "bf16":
                return outs
            rng = np.random.default_rng(0)
            return [o + rng.normal(0, 1, o.shape).astype(o.dtype) * np.abs(o).max() for o in outs]

    monkeypatch.setattr(ov_export, "OpenVinoModel", NoisyInBf16)  # what the export's bf16 judgement opens
    out = tmp_path / "out"
    report = export_openvino(source("feature-extraction"), out, quantize="int8").report
    manifest = read_manifest(out)
    assert manifest["int8_precision"].startswith("f32: bf16 fails the int8 gate") and \
        "inference_precisions" not in manifest
    assert rows(report, "int8 vs fp32") and not [r for r in report.rows if "(bf16)" in r.output]
    assert hfport.pipeline("sentence-embedding", model=out).model.precision == "f32"


def test_a_cpu_without_bf16_records_f32_for_the_int8_ir(tmp_path):
    """Where OpenVINO computes no bf16 on the exporting CPU, the manifest records f32 for the int8 IR and says why,
    judging nothing (no IR is read: the capability decides first)."""
    from types import SimpleNamespace

    (tmp_path / QUANTIZED_IR_FILE).write_text("not read")
    core = SimpleNamespace(get_property=lambda device, key: ["FP32", "INT8", "EXPORT_IMPORT"])
    entries = ov_export.serving_precisions(SimpleNamespace(Core=lambda: core), tmp_path, tmp_path, None, (0.99, 0.98))
    assert entries == {"inference_precision": "f32", "int8_precision": "f32: OpenVINO computes no bf16 on this CPU"}


def test_a_manifest_precision_that_is_no_hint_is_refused(exported, tmp_path):
    out, _ = exported("feature-extraction")
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    manifest = read_manifest(folder)
    manifest["inference_precisions"] = {QUANTIZED_IR_FILE: "fp16"}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(OpenVinoModelError, match=r"inference_precisions\.openvino_model_qint8_quantized\.xml 'fp16' "
                                                 r"must be one of \['f32', 'bf16'\]"):
        hfport.pipeline("sentence-embedding", model=folder)
    assert hfport.pipeline("sentence-embedding", model=folder, dtype="float32").model.precision == "f32"


def test_feed_forward_scope_and_fused_attention(exported, source):
    """The fp32 IR holds attention as OpenVINO's one ScaledDotProductAttention op a layer (the additive trace), and
    the feed-forward scope selects the feed-forward's MatMuls by module path, never attention's."""
    out, _ = exported("feature-extraction")
    layers = json.loads((out / "config.json").read_text())["num_hidden_layers"]
    types = [op.get_type_name() for op in ov.Core().read_model(str(out / IR_FILE)).get_ops()]
    assert types.count("ScaledDotProductAttention") == layers and "Softmax" not in types
    scope = ov_export.OUTLIER_SCOPES[0].matmuls(hfport.AutoModel.from_pretrained(source("feature-extraction")))
    assert scope("/model/body/encoder/layers.1/ffn/up/MatMul") and scope("/model/body/encoder/layers.0/ffn/down/MatMul")
    assert not scope("/model/body/encoder/layers.0/attn/q/MatMul") and not scope("/model/head/dense/MatMul")
    assert ov_export.OUTLIER_SCOPES[-1].matmuls(hfport.AutoModel.from_pretrained(source("feature-extraction"))) is None


def test_changed_weights_fail_verify(exported, source, tmp_path):
    out, _ = exported("text-classification")
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    assert verify(folder).passed  # the recorded source, by itself
    model = ov.Core().read_model(str(folder / IR_FILE))
    table = max((op for op in model.get_ops() if op.get_type_name() == "Constant"),
                key=lambda op: np.prod(op.get_output_shape(0)))  # the word embeddings
    data = table.get_data().copy()
    data[:, 0] += 0.5  # one feature of every row: any probe text sees it (a uniform shift LayerNorm would undo)
    for target in list(table.output(0).get_target_inputs()):
        target.replace_source_output(ov.opset13.constant(data).output(0))
    ov.save_model(model, str(tmp_path / "changed.xml"), compress_to_fp16=False)
    del model
    (tmp_path / "changed.bin").replace(folder / "openvino_model.bin")  # the same layout: only the values differ
    report = verify(folder, source("text-classification"))
    assert not report.passed
    failed = {(r.check, r.output) for r in report.failures}
    assert ("files", "openvino_model.bin") in failed  # the recorded sha256
    assert ("files", IR_FILE) not in failed
    assert any(check == "fp32 vs hfport" for check, _ in failed)  # and the values
    bare = tmp_path / "bare"
    shutil.copytree(out, bare)
    (bare / MANIFEST).unlink()  # nothing then says the IRs are the ones exported
    report = verify(bare, source("text-classification"))
    assert ("files", MANIFEST) in {(r.check, r.output) for r in report.failures}


def test_folder_whose_source_is_gone_verifies_against_the_runtime(exported, tmp_path):
    out, _ = exported("question-answering")
    folder = tmp_path / "moved"
    shutil.copytree(out, folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["source"] = str(tmp_path / "gone")
    (folder / MANIFEST).write_text(json.dumps(manifest))  # not a recorded file: its sha256 is the IRs'
    report = verify(folder)
    assert report.passed, report.table()
    assert "run by OpenVINO directly" in report.source and rows(report, "fp32 vs OpenVINO")


def test_gate_that_cannot_judge_refuses(source, tmp_path):
    few = tmp_path / "few.txt"
    few.write_text("\n".join(TEXTS) + "\n")
    with pytest.raises(ExportError, match="64"):
        export_openvino(source("text-classification"), tmp_path / "out", quantize="int8", gate_data=few)
    no_leftovers(tmp_path / "out")


# --- the CLI, and the missing extra ---------------------------------------------------------------------------


def test_cli_export_verify_and_predict(source, tmp_path):
    out = tmp_path / "out"
    run = CliRunner().invoke(app, ["export", str(source("feature-extraction")), "--out", str(out), "--format",
                                   "openvino", "--quantize", "int8", "--verify", "--min-agreement", "0.98",
                                   "--json", str(tmp_path / "report.json")])
    assert run.exit_code == 0, run.output
    assert "int8 vs fp32" in run.output and "PASS" in run.output
    assert (out / QUANTIZED_IR_FILE).is_file() and json.loads((tmp_path / "report.json").read_text())["passed"]
    assert "Statistics collection" not in run.output  # NNCF's progress bars stay off the CLI's stdout
    checked = CliRunner().invoke(app, ["verify", str(out)])
    assert checked.exit_code == 0 and "int8 vs fp32" in checked.output, checked.output
    predicted = CliRunner().invoke(app, ["predict", str(out), *TEXTS, "--task", "sentence-embedding"])
    assert predicted.exit_code == 0, predicted.output
    lines = [json.loads(line) for line in predicted.output.splitlines()]
    pipe = hfport.pipeline("sentence-embedding", model=out)
    np.testing.assert_allclose(np.array(lines), np.array(pipe(TEXTS)), atol=1e-6)
    bad = CliRunner().invoke(app, ["export", str(source("feature-extraction")), "--out", str(tmp_path / "x"),
                                   "--format", "openvino", "--opset", "17"])
    assert bad.exit_code == 1 and "--opset: only with --format onnx" in bad.output


def test_missing_extra_says_what_to_install(source, exported, tmp_path, hide_packages):
    out, _ = exported("text-classification")
    hide_packages("openvino", "nncf")
    with pytest.raises(ExportError, match=r"pip install 'hfport\[openvino\]'"):
        export_openvino(source("text-classification"), tmp_path / "out")
    run = CliRunner().invoke(app, ["export", str(source("text-classification")), "--out", str(tmp_path / "out"),
                                   "--format", "openvino-int8"])
    assert run.exit_code == 1 and "pip install 'hfport[openvino]'" in run.output
    no_leftovers(tmp_path / "out")
    with pytest.raises(OpenVinoModelError, match=r"pip install 'hfport\[openvino\]'"):
        hfport.pipeline("text-classification", model=out)
    report = verify(out)
    assert not report.passed and "pip install 'hfport[openvino]'" in report.table()


def test_core_imports_without_the_extra():
    """hfport, its export registry and its pipelines import with openvino and nncf absent."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('openvino', 'nncf'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import hfport, hfport.pipelines, hfport.cli\n"
            "from hfport.export import FORMATS\n"
            "assert 'openvino' in FORMATS and 'openvino' not in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr


def test_info_describes_an_openvino_folder(exported):
    """`hfport info` on an OpenVINO folder: the IR it serves and the precision it computes in."""
    out, _ = exported("text-classification")
    facts = json.loads(CliRunner().invoke(app, ["info", str(out), "--json"]).output)
    assert facts["format"] == "openvino" and QUANTIZED_IR_FILE in facts["graph"]
    assert facts["head"] == "text-classification" and "load_report" not in facts
    f32 = json.loads(CliRunner().invoke(app, ["info", str(out), "--json", "--dtype", "float32"]).output)
    assert "(f32)" in f32["graph"]
