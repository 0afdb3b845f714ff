"""bf16 where the CPU computes it natively: the measured capability and its cache, the precision decisions, and
that bf16 keeps the answers (parity against transformers' own bf16, task-level agreement with fp32, training
quality, exact resume).

Tolerances: bf16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%), and under autocast every matmul input
is rounded to it, so two correct bf16 implementations differ by roughly their distance from fp32. The parity tests
therefore bound hfport's bf16 error by a small multiple of transformers' bf16 error on the same batch, rather than
by a fixed number.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import hfport
import hfport.settings
from hfport.train.monitor import is_perf
from hfport import hardware
from hfport.cli import app
from hfport.errors import ConfigError
from hfport.train.loop import mixed_precision

from . import tiny
from .test_finetune import base_config, sentiment_run

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU precision rules apply without CUDA")
NATIVE = {"float32": 100.0, "bfloat16": 400.0}
EMULATED = {"float32": 100.0, "bfloat16": 40.0}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache dir of the test's own, and no capabilities remembered from earlier in the process."""
    hfport.settings.use(cache_dir=tmp_path / "cache")  # conftest resets the settings after the test
    hardware._memo.clear()
    yield tmp_path / "cache" / hardware.CACHE_FILE
    hardware._memo.clear()


class FakeProbe:
    """Stands in for hardware.measure (the real probe has its own test): set peaks, counted calls."""

    def __init__(self):
        self.peaks, self.calls = NATIVE, 0

    def __call__(self, **kwargs) -> dict[str, float]:
        assert kwargs == {"per_core": True}, kwargs  # the decision is measured on one thread, by CPU time
        self.calls += 1
        return dict(self.peaks)


@pytest.fixture
def fake_measure(cache, monkeypatch) -> FakeProbe:
    probe = FakeProbe()
    monkeypatch.setattr(hardware, "measure", probe)
    return probe


# --- 1. the capability and its cache ---------------------------------------------------------------------------


def test_real_probe_measures_and_caches(cache):
    threads = torch.get_num_threads()
    caps = hardware.cpu_capabilities()
    assert caps.source == "measured" and caps.peaks["float32"] > 0 and caps.peaks["bfloat16"] > 0
    assert caps.threads == 1 and torch.get_num_threads() == threads  # one thread for the probe, then restored
    assert caps.bf16_native == (caps.peaks["bfloat16"] / caps.peaks["float32"] >= hardware.NATIVE_MARGIN)
    saved = json.loads(cache.read_text())
    assert saved["cpu"] == hardware.cpu_name() and saved["torch"] == torch.__version__
    assert saved["peaks"] == caps.peaks
    hardware._memo.clear()
    again = hardware.cpu_capabilities()
    assert again.source == "cache" and again.peaks == caps.peaks


def test_cache_is_read_not_remeasured(fake_measure, cache):
    hardware.cpu_capabilities()
    hardware._memo.clear()
    assert hardware.cpu_capabilities().source == "cache" and fake_measure.calls == 1


@pytest.mark.parametrize("field, value", [("torch", "1.0.0"), ("cpu", "Some Other CPU"), ("cores", 4096),
                                          ("format", 0)])
def test_stale_cache_is_remeasured(fake_measure, cache, field, value):
    hardware.cpu_capabilities()
    stale = json.loads(cache.read_text()) | {field: value, "peaks": EMULATED}
    cache.write_text(json.dumps(stale))
    hardware._memo.clear()
    caps = hardware.cpu_capabilities()
    assert caps.source == "measured" and fake_measure.calls == 2 and caps.peaks == NATIVE
    assert json.loads(cache.read_text())[field] != value  # replaced by this machine's entry


@pytest.mark.parametrize("content", ["{not json", "[]", '{"cpu": "x"}', "", "\x00\xff"])
def test_corrupt_cache_is_remeasured(fake_measure, cache, content, caplog):
    cache.parent.mkdir(parents=True)
    cache.write_text(content)
    with caplog.at_level(logging.WARNING, "hfport.hardware"):
        caps = hardware.cpu_capabilities()
    assert caps.source == "measured" and fake_measure.calls == 1
    assert str(cache) in caplog.text and "measuring again" in caplog.text
    assert json.loads(cache.read_text())["peaks"] == NATIVE


def test_cache_with_bad_peaks_is_remeasured(fake_measure, cache):
    hardware.cpu_capabilities()
    cache.write_text(json.dumps(json.loads(cache.read_text()) | {"peaks": {"float32": 0.0, "bfloat16": 5.0}}))
    hardware._memo.clear()
    assert hardware.cpu_capabilities().source == "measured" and fake_measure.calls == 2


def test_unwritable_cache_dir_still_answers(fake_measure, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache dir should be")
    hfport.settings.use(cache_dir=blocker / "sub")
    with caplog.at_level(logging.WARNING, "hfport.hardware"):
        assert hardware.cpu_capabilities().bf16_native
    assert "could not write" in caplog.text


@pytest.mark.parametrize("bf16, native", [(149.0, False), (150.0, True), (40.0, False), (835.0, True)])
def test_native_means_a_clear_margin(bf16, native):
    caps = hardware.Capabilities(cpu="c", cores=2, torch="t", threads=2, peaks={"float32": 100.0, "bfloat16": bf16},
                                 measured_at="now")
    assert caps.bf16_native is native


def test_cli_info_hardware(fake_measure, cache):
    runner = CliRunner()
    result = runner.invoke(app, ["info", "--hardware", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["peaks"] == NATIVE and out["bf16_native"] is True and out["bf16_speedup"] == 4.0
    assert out["cache_file"] == str(cache)
    text = runner.invoke(app, ["info", "--hardware"]).output
    assert "bfloat16" in text and "400.0 GFLOP/s" in text and "bf16: native (4.00x float32" in text
    assert fake_measure.calls == 1  # the second call read the cache
    assert runner.invoke(app, ["info", "--hardware", "--remeasure", "--json"]).exit_code == 0
    assert fake_measure.calls == 2
    missing = runner.invoke(app, ["info"])
    assert missing.exit_code != 0 and "--hardware" in missing.output


# --- 2. precision decisions ---------------------------------------------------------------------------------------


@CPU_ONLY
@pytest.mark.parametrize("peaks, auto", [(NATIVE, "bf16"), (EMULATED, "no")])
def test_precision_auto_follows_the_measurement(fake_measure, peaks, auto):
    fake_measure.peaks = peaks
    assert mixed_precision("auto") == auto
    assert mixed_precision("fp32") == "no"
    with pytest.raises(ConfigError, match="'fp16' needs a CUDA GPU"):
        mixed_precision("fp16")


@CPU_ONLY
def test_forced_bf16_without_native_warns_once_with_the_slowdown(fake_measure, caplog):
    fake_measure.peaks = EMULATED
    with caplog.at_level(logging.WARNING, "hfport.train"):
        assert mixed_precision("bf16") == "bf16"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "0.40x fp32" in warnings[0].getMessage() and "40 vs 100" in warnings[0].getMessage()
    caplog.clear()
    fake_measure.peaks = NATIVE
    hardware._memo.clear()
    hardware.cache_path().unlink()
    with caplog.at_level(logging.WARNING, "hfport.train"):
        assert mixed_precision("bf16") == "bf16"
    assert not caplog.records


@CPU_ONLY
@pytest.mark.parametrize("peaks, expected", [(NATIVE, torch.bfloat16), (EMULATED, torch.float32)])
def test_dtype_auto_on_the_cpu(fake_measure, tmp_path, peaks, expected):
    fake_measure.peaks = peaks
    tiny.save_hf("bert", "base", tmp_path / "fp32")
    assert hfport.AutoModel.from_pretrained(tmp_path / "fp32", dtype="auto").dtype == expected
    assert hfport.AutoModel.from_pretrained(tmp_path / "fp32").dtype == torch.float32  # None stays fp32
    # a half-precision checkpoint keeps its dtype, as in transformers
    tiny.build_hf("bert", "base").to(torch.float16).save_pretrained(tmp_path / "fp16")
    assert hfport.AutoModel.from_pretrained(tmp_path / "fp16", dtype="auto").dtype == torch.float16


# --- 3. parity with transformers in bf16 -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "roberta", "deberta-v2"])
def test_bf16_autocast_parity_with_transformers(family, tmp_path):
    """hfport under bf16 autocast vs transformers under bf16 autocast, outputs and loss at real positions, padded
    batch with pairs and a 70-token row: hfport's distance from the fp32 answer is at most 2x transformers' own
    (+ 1e-3 for the rare output where transformers happens to land almost exactly on fp32), and under 0.1."""
    tiny.save_hf(family, "sequence-classification", tmp_path / "m")
    hf = tiny.build_hf(family, "sequence-classification")
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "m").eval()
    # the bare encoders: hfport's AutoModel on the same folder (the head's keys unused), transformers' base_model
    bases = {id(hf): hf.base_model, id(ours): hfport.AutoModel.from_pretrained(tmp_path / "m").eval()}
    batch = tiny.batch(family)
    labels = torch.tensor([0, 2, 1])
    real = batch["attention_mask"].bool()

    def run(model, bf16: bool, hidden: bool):
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            if hidden:  # the encoder's last hidden state, at real positions
                body = bases[id(model)]
                return body(**batch).last_hidden_state.float()[real]
            logits = model(**batch).logits.float()
        return torch.cat([logits.flatten(), torch.nn.functional.cross_entropy(logits, labels)[None]])

    for hidden in (True, False):
        ref = run(hf, False, hidden)
        theirs, mine = run(hf, True, hidden), run(ours, True, hidden)
        torch.testing.assert_close(run(ours, False, hidden), ref, atol=1e-5, rtol=1e-4)  # fp32 stays exact
        their_err, my_err = (theirs - ref).abs().max().item(), (mine - ref).abs().max().item()
        assert their_err > 0, "transformers' bf16 run equals its fp32 run: autocast did not engage"
        assert my_err <= 2 * their_err + 1e-3 and my_err < 0.1, (family, hidden, my_err, their_err)


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_bf16_autocast_gradients_match_transformers(family, tmp_path, monkeypatch):
    """Training under bf16 autocast (what precision auto runs here), where attention takes the math form instead of
    the fused kernel (nn/attention.py: the fused CPU backward is slow in bf16): the loss and the word-embedding
    gradient, which every layer's backward flows into, are at most 2x transformers' own bf16 distance from the fp32
    answer (relative, in norm; + 1e-3 for a loss that lands almost exactly on fp32). Dropout off, so both runs are
    deterministic."""
    from hfport.nn import attention

    math_calls = []
    eager = attention.eager_attention
    monkeypatch.setattr(attention, "eager_attention", lambda *a, **k: math_calls.append(1) or eager(*a, **k))
    tiny.save_hf(family, "sequence-classification", tmp_path / "m")
    hf = tiny.build_hf(family, "sequence-classification").eval()
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "m").eval()
    batch, labels = tiny.batch(family), torch.tensor([0, 2, 1])
    tables = {id(hf): hf.get_input_embeddings().weight, id(ours): ours.get_input_embeddings().weight}

    def run(model, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            logits = model(**batch).logits
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        return loss.detach(), tables[id(model)].grad.clone()

    ref_loss, ref_grad = run(hf, False)
    my_loss, my_grad = run(ours, False)
    torch.testing.assert_close(my_loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(my_grad, ref_grad, atol=1e-5, rtol=1e-4)  # summed rows: fp32 stays exact
    calls = len(math_calls)
    their_loss, their_grad = run(hf, True)
    my_loss, my_grad = run(ours, True)
    assert len(math_calls) > calls, "bf16 training did not take the math attention"

    def rel(grad: torch.Tensor) -> float:
        return ((grad - ref_grad).norm() / ref_grad.norm()).item()

    assert rel(their_grad) > 0, "transformers' bf16 run equals its fp32 run: autocast did not engage"
    assert rel(my_grad) <= 2 * rel(their_grad), (family, rel(my_grad), rel(their_grad))
    assert (my_loss - ref_loss).abs() <= 2 * (their_loss - ref_loss).abs() + 1e-3


# --- 4. inference: dtype="auto" agrees with fp32 at the task level (real MiniLM) -----------------------------------


TEXTS = ["The film was wonderful and the acting superb.", "A dreadful plot, poor pacing, and a terrible ending.",
         "Paris is the capital of France.", "Marie Curie won the Nobel Prize in Physics in 1903.",
         "I would not watch it again.", "The soundtrack is the best part of this otherwise forgettable movie, "
         "which drags on for nearly three hours without much happening at all.", "ok", "Berlin in winter."]


def _auto_and_fp32(task: str, folder: Path, **kwargs):
    return (hfport.pipeline(task, model=folder, dtype="auto", **kwargs),
            hfport.pipeline(task, model=folder, **kwargs))


@pytest.fixture(scope="module")
def native() -> bool:
    return hardware.cpu_capabilities().bf16_native


def test_auto_feature_extraction_embeddings(minilm_path, native):
    auto, fp32 = _auto_and_fp32("feature-extraction", minilm_path, pooling="mean", normalize=True)
    assert auto.model.dtype == (torch.bfloat16 if native else torch.float32)
    a, b = torch.tensor(auto(TEXTS)), torch.tensor(fp32(TEXTS))
    cos = (a * b).sum(-1)
    assert cos.min() >= 0.99, cos
    if native:  # not the fp32 answer: the run really was bf16
        assert cos.min() < 1 - 1e-7


def _agree_where_clear(pairs: list[tuple[str, str, float]], margin: float) -> int:
    """(auto's answer, fp32's answer, fp32's margin between its best and second-best answer): answers agree
    wherever fp32's margin is clear; near-ties may swap under 8-bit rounding. Returns how many were clear."""
    clear = [(a, b) for a, b, m in pairs if m > margin]
    assert all(a == b for a, b in clear), clear
    return len(clear)


def test_auto_text_classification_labels(minilm_heads):
    auto, fp32 = _auto_and_fp32("text-classification", minilm_heads["sequence-classification"], top_k=2)
    pairs = [(a[0]["label"], b[0]["label"], b[0]["score"] - b[1]["score"]) for a, b in zip(auto(TEXTS), fp32(TEXTS))]
    assert _agree_where_clear(pairs, margin=0.02) >= len(TEXTS) // 2


def test_auto_token_classification_tags(minilm_heads):
    auto, fp32 = _auto_and_fp32("token-classification", minilm_heads["token-classification"])
    auto_model, fp32_model = auto.model, fp32.model
    tok = hfport.AutoTokenizer.from_pretrained(minilm_heads["token-classification"])
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        pa = auto_model(**enc).logits.float().softmax(-1)
        pb = fp32_model(**enc).logits.softmax(-1)
    top2 = pb.topk(2, dim=-1).values
    real = enc["attention_mask"].bool()
    pairs = [(int(x), int(y), float(m)) for x, y, m in zip(pa.argmax(-1)[real], pb.argmax(-1)[real],
                                                           (top2[..., 0] - top2[..., 1])[real])]
    assert _agree_where_clear(pairs, margin=0.02) >= len(pairs) // 2
    # and the pipeline's entities (tags with their word spans) match wherever the per-token decision was clear
    ents_a, ents_b = auto(TEXTS), fp32(TEXTS)
    assert sum(len(x) for x in ents_b) > 0
    same = sum(1 for x, y in zip(ents_a, ents_b) for ea, eb in zip(x, y)
               if (ea["entity"], ea["start"], ea["end"]) == (eb["entity"], eb["start"], eb["end"]))
    assert same >= 0.8 * sum(len(x) for x in ents_b)


def test_auto_question_answering_spans(minilm_heads):
    auto, fp32 = _auto_and_fp32("question-answering", minilm_heads["question-answering"])
    questions = [{"question": q, "context": c} for q, c in [
        ("Who won the prize?", "Marie Curie won the Nobel Prize in Physics in 1903 and in Chemistry in 1911."),
        ("What is the capital?", "Paris is the capital of France; Berlin is the capital of Germany."),
        ("Who wrote it?", "Herman Melville wrote Moby-Dick in 1851, a novel about the whale and Captain Ahab."),
        ("Where does the fox jump?", "The quick brown fox jumps over the lazy dog near the river bank.")]]
    pairs = []
    for a, b in zip(auto(questions, top_k=2), fp32(questions, top_k=2)):
        pairs.append(((a[0]["start"], a[0]["end"]), (b[0]["start"], b[0]["end"]),
                      math.log(b[0]["score"] / max(b[1]["score"], 1e-12))))
    assert _agree_where_clear(pairs, margin=0.1) >= 2


def test_auto_fill_mask_top_k(minilm_heads):
    auto, fp32 = _auto_and_fp32("fill-mask", minilm_heads["masked-lm"], top_k=5)
    texts = ["Paris is the [MASK] of France.", "The film was [MASK].", "She won the Nobel [MASK] in 1903.",
             "The quick brown [MASK] jumps over the lazy dog."]
    for a, b in zip(auto(texts), fp32(texts)):
        overlap = {x["token"] for x in a} & {x["token"] for x in b}
        assert len(overlap) >= 4, (a, b)


# --- 5. training: bf16 learns as well as fp32, and resumes exactly -----------------------------------------------


@pytest.fixture(scope="module")
def ftdir(tmp_path_factory, minilm_path) -> Path:
    return sentiment_run(tmp_path_factory.mktemp("bf16ft"), minilm_path, 192, 64)


def test_bf16_fine_tune_reaches_the_fp32_quality(ftdir, tmp_path):
    """The same 4-epoch fine-tune (seed 7) in fp32 and in bf16 autocast: both learn the task (accuracy >= 0.9) and
    end within 0.05 accuracy and 0.1 eval loss of each other (bf16 rounds every matmul input to 8 bits; the
    optimizer and the loss stay fp32, so the runs drift apart only slowly)."""
    results = {}
    for precision in ("fp32", "bf16"):
        summary = hfport.finetune(base_config(ftdir, tmp_path / precision, precision=precision, epochs=4),
                                  progress=False)
        results[precision] = summary["final_eval"]
    fp32, bf16 = results["fp32"], results["bf16"]
    assert fp32["eval_accuracy"] >= 0.9 and bf16["eval_accuracy"] >= 0.9, results
    assert abs(fp32["eval_accuracy"] - bf16["eval_accuracy"]) <= 0.05, results
    assert abs(fp32["eval_loss"] - bf16["eval_loss"]) <= 0.1, results
    assert fp32["eval_loss"] != bf16["eval_loss"], "bf16 ran as fp32"


def test_bf16_resume_is_bit_identical(ftdir, tmp_path):
    """Stop after step 3 (max_steps), resume to step 6: the same weights bit for bit as an unbroken bf16 run."""
    def config(out: Path, **kw):
        return base_config(ftdir, out, precision="bf16", batch_size=16, save_steps=3, eval_strategy="no",
                           eval=None, eval_fraction=0.0, **kw)

    hfport.finetune(config(tmp_path / "ref", max_steps=6), progress=False)
    hfport.finetune(config(tmp_path / "cut", max_steps=6, save_total_limit=5), progress=False)
    # the second run again from its step-3 checkpoint: steps 4-6 recomputed over what it wrote the first time
    cut = tmp_path / "cut"
    shutil.rmtree(cut / "final")  # so the comparison below reads what the resumed run wrote
    hfport.finetune(config(cut, max_steps=6, resume=str(cut / "checkpoints" / "step-3")), progress=False)
    ref, resumed = (load_file(str(p / "final" / "model.safetensors")) for p in (tmp_path / "ref", cut))
    assert ref.keys() == resumed.keys()
    assert all(torch.equal(ref[k], resumed[k]) for k in ref)
    # perf lines (speed, ETA, memory) are the machine's, different every run; train/eval lines must be identical
    assert [x for x in (cut / "metrics.jsonl").read_text().splitlines() if not is_perf(json.loads(x))] == \
        [x for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines() if not is_perf(json.loads(x))]
