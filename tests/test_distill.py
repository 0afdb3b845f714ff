"""Distillation (hfport/train/distill.py): the losses against torch's and sentence-transformers' own, the mixed loss of
a batch by hand, alpha 0 as plain fine-tuning bit for bit, rows without labels, the teacher run once and reused by a
resumed run (bit-identical, a learned projection included), students of some of a model's layers against
transformers' model with the same layers removed, and the config's and preflight's checks. Tiny models with MiniLM's
tokenizer; every test gets its own cache dir (the teacher's stored outputs live there).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import hfport
from hfport.errors import ConfigError
from hfport.train import distill
from hfport.train.config import FinetuneConfig, resolve_config
from hfport.train.data import DataError
from hfport.train.loop import finetune
from hfport.train.monitor import is_perf
from hfport.train.preflight import preflight
from hfport.train.tasks.embedding import SentenceEmbedding
from tests.tiny import batch as tiny_batch
from tests.tiny import TOKENIZER_FILES, build_hf, save_random_adapter, save_with_tokenizer

NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SENTIMENT = {0: "negative", 1: "positive"}
GOOD, BAD = ["great", "lovely", "superb", "fine"], ["awful", "dull", "poor", "bad"]


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HFPORT_CACHE_DIR", str(tmp_path / "cache"))


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _review(rng: random.Random, label: str) -> str:
    word = rng.choice(GOOD if label == "positive" else BAD)
    return f"the {rng.choice(['film', 'plot', 'cast'])} was {word} " + " ".join(
        rng.choice(["and", "so", "we", "left", "then"]) for _ in range(rng.randint(0, 12)))


@pytest.fixture(scope="module")
def root(tmp_path_factory, minilm_path) -> Path:
    """Tiny models with MiniLM's tokenizer: a 4-layer sentiment teacher, a 2-layer student base (dropout on), a tag
    teacher, a one-logit reranker teacher, a 48-wide embedding teacher and a 32-wide student; and their data."""
    root = tmp_path_factory.mktemp("distill")
    labels = dict(id2label=SENTIMENT, label2id={v: k for k, v in SENTIMENT.items()})
    teacher = build_hf("bert", "sequence-classification", seed=3, vocab_size=30522, num_hidden_layers=4, **labels,
                       **NO_DROPOUT)
    with torch.no_grad():  # a head of std 1, not the init's 0.02: logits that differ, as a trained teacher's do
        teacher.classifier.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    teacher.save_pretrained(root / "teacher")
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_path / name, root / "teacher" / name)
    save_with_tokenizer("bert", "base", root / "student", minilm_path, vocab_size=30522)
    tags = {0: "O", 1: "B-PER", 2: "I-PER"}
    save_with_tokenizer("bert", "token-classification", root / "tagger", minilm_path, seed=4, vocab_size=30522,
                        id2label=tags, label2id={v: k for k, v in tags.items()}, **NO_DROPOUT)
    save_with_tokenizer("bert", "sequence-classification", root / "reranker", minilm_path, seed=5, vocab_size=30522,
                        num_labels=1, **NO_DROPOUT)
    save_with_tokenizer("bert", "base", root / "wide", minilm_path, seed=6, vocab_size=30522, hidden_size=48,
                        **NO_DROPOUT)
    rng = random.Random(0)
    rows = [{"text": _review(rng, label), "label": label}
            for label in (rng.choice(["negative", "positive"]) for _ in range(48))]
    _jsonl(root / "labelled.jsonl", rows)
    _jsonl(root / "eval.jsonl", rows[:16])
    _jsonl(root / "mixed.jsonl", [r if k % 3 else {"text": r["text"]} for k, r in enumerate(rows)])  # 0, 3, ...: none
    _jsonl(root / "unlabelled.jsonl", [{"text": r["text"]} for r in rows])
    words = ["alice", "bob", "met", "in", "paris", "today", "and", "left"]
    sentences = [[rng.choice(words) for _ in range(rng.randint(2, 9))] for _ in range(24)]
    _jsonl(root / "ner.jsonl", [{"tokens": s, **({"tags": ["B-PER" if w in ("alice", "bob") else "O" for w in s]}
                                                 if k % 2 else {})} for k, s in enumerate(sentences)])
    _jsonl(root / "ner_eval.jsonl", [{"tokens": s, "tags": ["B-PER" if w in ("alice", "bob") else "O" for w in s]}
                                     for s in sentences[:8]])
    _jsonl(root / "pairs.jsonl", [{"anchor": r["text"], "positive": rows[(k + 1) % len(rows)]["text"]}
                                  for k, r in enumerate(rows)])
    _jsonl(root / "triplets.jsonl", [{"anchor": r["text"], "positive": rows[(k + 1) % len(rows)]["text"],
                                      "negative": rows[(k + 5) % len(rows)]["text"]} for k, r in enumerate(rows)])
    _jsonl(root / "rerank.jsonl", [{"query": f"query {k}", "positive": rows[k]["text"],
                                    "negatives": [rows[k + 1]["text"], rows[k + 2]["text"]]} for k in range(24)])
    return root


def _config(root: Path, out: Path, **overrides) -> FinetuneConfig:
    values = dict(model=str(root / "student"), teacher=str(root / "teacher"), train=str(root / "labelled.jsonl"),
                  eval=str(root / "eval.jsonl"), output_dir=str(out), batch_size=8, lr=3e-3, logging_steps=1,
                  seed=7, precision="fp32", max_steps=4)
    return FinetuneConfig(**{**values, **overrides})


def _lines(out: Path) -> list[str]:
    return [x for x in (out / "metrics.jsonl").read_text().splitlines() if not is_perf(json.loads(x))]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


# --- the losses against their references --------------------------------------------------------------------------


def test_the_losses_equal_torch_and_sentence_transformers():
    """KL * T^2 is DistilBERT's kl_div(batchmean) * T^2; multi-label's binary KL is BCE against the teacher's
    probabilities less their entropy; the embedding losses are sentence-transformers' MSELoss (with its projection)
    and MarginMSELoss, computed by sentence-transformers itself."""
    from sentence_transformers.sentence_transformer.losses import MarginMSELoss, MSELoss

    g = torch.Generator().manual_seed(0)
    s, t, temperature = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g) * 3, 2.5
    reference = F.kl_div(F.log_softmax(s / temperature, -1), F.softmax(t / temperature, -1),
                         reduction="batchmean") * temperature ** 2
    torch.testing.assert_close(distill.kl_divergence(s, t, temperature).mean(), reference)
    p = torch.sigmoid(t / temperature)
    binary = (F.binary_cross_entropy_with_logits(s / temperature, p)
              - F.binary_cross_entropy_with_logits(t / temperature, p)) * temperature ** 2
    torch.testing.assert_close(distill.binary_kl_divergence(s, t, temperature).mean(), binary)

    # a batch of 4 triplets over 10 distinct texts: rows of `embeddings`, `index` (B, 3) as collate makes it
    task = SentenceEmbedding()
    embeddings, index = torch.randn(10, 8, generator=g), torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 1, 5]])
    teacher_scores = torch.randn(4, 2, generator=g)  # each row's teacher (positive, negative) dot products
    data = type("Data", (), {"extra": {"triplets": True}})()
    ours, _ = task.distill_terms(embeddings, {"labels": index}, teacher_scores.flatten(), data, 1.0, None)
    q, pos, neg = (embeddings[index[:, k]] for k in range(3))
    torch.testing.assert_close(ours.mean(), MarginMSELoss(None).compute_loss_from_embeddings([q, pos, neg],
                                                                                           teacher_scores))
    teacher_vectors = torch.randn(4, 3, 12, generator=g)  # 12 wide: through the student's projection
    projection = torch.nn.Linear(8, 12)
    reference = MSELoss(None)
    reference.projection = projection
    data.extra["triplets"] = False
    ours, _ = task.distill_terms(embeddings, {"labels": index}, teacher_vectors.flatten(), data, 1.0, projection)
    torch.testing.assert_close(ours.mean(), reference.compute_loss_from_embeddings(
        [q, pos, neg], [teacher_vectors[:, k] for k in range(3)]))


def test_a_batch_loss_is_the_hand_computed_mix(root, tmp_path):
    """Rows 0, 3, 6 have no label: alpha * KL over the labelled rows + KL over the others, over all rows, plus
    (1 - alpha) * the cross-entropy of the labelled rows times their share; a batch of unlabelled rows alone is the
    mean KL. The teacher's stored logits are its logits for those rows."""
    alpha, temperature = 0.3, 3.0
    checked = preflight(_config(root, tmp_path / "run", train=str(root / "mixed.jsonl"), distill_alpha=alpha,
                                distill_temperature=temperature))
    checked.task.before_training(checked.data, torch.device("cpu"))
    student = hfport.AutoModelForSequenceClassification.from_pretrained(root / "student", id2label=SENTIMENT)
    teacher = hfport.AutoModelForSequenceClassification.from_pretrained(root / "teacher")
    for rows in (list(range(8)), [0, 3, 6]):
        items = [checked.data.train[i] for i in rows]
        batch = checked.task.collate(items, checked.data, seed=0)
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
        outputs = student(**inputs)
        loss = checked.task.loss(outputs, batch, checked.data, None, 0.0)
        s, t, labels = outputs.logits, teacher(**inputs).logits, batch["labels"]
        torch.testing.assert_close(batch["teacher"].view_as(t), t)  # what the store holds: the teacher's logits
        kl = F.kl_div(F.log_softmax(s / temperature, -1), F.softmax(t / temperature, -1),
                      reduction="none").sum(-1) * temperature ** 2  # (B,)
        own = labels != -100
        assert own.tolist() == [k % 3 != 0 for k in rows]
        reference = (alpha * kl[own].sum() + kl[~own].sum()) / len(rows)
        if own.any():
            reference = reference + (1 - alpha) * F.cross_entropy(s[own], labels[own]) * own.sum() / len(rows)
        torch.testing.assert_close(loss, reference)


def test_alpha_zero_is_plain_fine_tuning_bit_for_bit(root, tmp_path):
    """distill_alpha 0 on labelled rows: the same weights and metrics lines as the run without a teacher (the
    teacher's pass draws nothing from the run's random streams; its term is 0 exactly)."""
    finetune(_config(root, tmp_path / "plain", teacher=None, save_strategy="no"), progress=False)
    finetune(_config(root, tmp_path / "taught", distill_alpha=0.0, save_strategy="no"), progress=False)
    plain, taught = _weights(tmp_path / "plain" / "final"), _weights(tmp_path / "taught" / "final")
    assert plain.keys() == taught.keys() and all(torch.equal(plain[k], taught[k]) for k in plain)
    assert _lines(tmp_path / "plain") == _lines(tmp_path / "taught")
    finetune(_config(root, tmp_path / "half", save_strategy="no", eval_strategy="no"), progress=False)
    other = _weights(tmp_path / "half" / "final")
    assert any(not torch.equal(plain[k], other[k]) for k in plain), "the teacher changed nothing at alpha 0.5"


def test_unlabelled_texts_learn_from_the_teacher(root, tmp_path):
    """A training file without a label column trains on the teacher alone (toward it: the student's KL to the
    teacher falls), evaluated on labelled rows; the student has the teacher's labels."""
    config = _config(root, tmp_path / "run", train=str(root / "unlabelled.jsonl"), max_steps=6, lr=5e-3,
                     eval_strategy="no", save_strategy="no")
    summary = finetune(config, progress=False)
    assert summary["labels"] == {str(k): v for k, v in SENTIMENT.items()} or summary["labels"] == SENTIMENT
    losses = [json.loads(x)["loss"] for x in _lines(tmp_path / "run") if json.loads(x)["type"] == "train"]
    assert losses[-1] < losses[0] / 2, losses


def test_the_teacher_runs_once_and_a_resumed_run_is_bit_identical(root, tmp_path, monkeypatch):
    """The teacher's pass runs for the first run only; the run resumed from its step-2 checkpoint reads the stored
    outputs and ends with the same weights and metrics lines."""
    calls = []
    original = distill.teacher_rows

    def counted(*args, **kwargs):
        calls.append(1)
        yield from original(*args, **kwargs)

    monkeypatch.setattr(distill, "teacher_rows", counted)

    def config(out: Path, **kw) -> FinetuneConfig:
        return _config(root, out, train=str(root / "mixed.jsonl"), max_steps=6, save_steps=2, save_total_limit=10,
                       eval_strategy="steps", eval_steps=3, **kw)

    finetune(config(tmp_path / "ref"), progress=False)
    assert len(calls) == 1
    resumed = tmp_path / "resumed"
    finetune(config(resumed, resume=str(tmp_path / "ref" / "checkpoints" / "step-2")), progress=False)
    assert len(calls) == 1, "the resumed run ran the teacher again"
    ref = _weights(tmp_path / "ref" / "final")
    assert all(torch.equal(ref[k], v) for k, v in _weights(resumed / "final").items())
    assert _lines(resumed) == [x for x in _lines(tmp_path / "ref") if json.loads(x)["step"] > 2]


def test_an_embedding_student_learns_a_wider_teacher_through_a_projection(root, tmp_path):
    """A 32-wide student, a 48-wide teacher: MSE through the projection, which the checkpoints hold (a run resumed
    from step 2 ends bit-identical; without the projection restored it would restart from its initial weights) and
    best/ and final/ do not (they are the student's folders, 32 wide)."""
    def config(out: Path, **kw) -> FinetuneConfig:
        return _config(root, out, task="sentence-embedding", teacher=str(root / "wide"),
                       train=str(root / "pairs.jsonl"), eval=None, eval_fraction=0.2, distill_alpha=1.0,
                       max_steps=5, save_steps=2, save_total_limit=10, **kw)

    finetune(config(tmp_path / "ref"), progress=False)
    step2 = tmp_path / "ref" / "checkpoints" / "step-2"
    assert load_file(str(step2 / "model.safetensors"))["companion.weight"].shape == (48, 32)
    final = _weights(tmp_path / "ref" / "final")
    assert not any(k.startswith("companion.") for k in final)
    assert final["embeddings.word_embeddings.weight"].shape[1] == 32
    finetune(config(tmp_path / "resumed", resume=str(step2)), progress=False)
    assert all(torch.equal(final[k], v) for k, v in _weights(tmp_path / "resumed" / "final").items())


@pytest.mark.parametrize("task, teacher, train, extra", [
    ("token-classification", "tagger", "ner.jsonl", {"eval": "ner_eval.jsonl"}),  # odd rows have no tags
    ("text-ranking", "reranker", "rerank.jsonl", {"eval": None, "eval_fraction": 0.25}),
    ("sentence-embedding", "student", "triplets.jsonl", {"eval": None, "eval_fraction": 0.25}),  # MarginMSE
])
def test_every_task_distils(root, tmp_path, task, teacher, train, extra):
    """Each task's run with its teacher completes and its distillation term moves the student (the first step's
    loss differs from the same run's at alpha 0)."""
    first = {}
    for alpha in (0.0, 0.5):
        values = {k: str(root / v) if isinstance(v, str) else v for k, v in extra.items()}
        out = tmp_path / f"alpha{alpha}"
        finetune(_config(root, out, task=task, teacher=str(root / teacher), train=str(root / train), max_steps=2,
                         distill_alpha=alpha, **values), progress=False)
        first[alpha] = next(json.loads(x)["loss"] for x in _lines(out) if json.loads(x)["type"] == "train")
        assert (out / "final" / "config.json").is_file()
    assert first[0.0] != first[0.5]


# --- students of some layers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, overrides, kept", [
    ("bert", dict(num_hidden_layers=4), [0, 2]),
    ("bert", dict(num_hidden_layers=4), [1, 3]),
    ("distilbert", dict(n_layers=4), [0, 3]),  # config.json's count is n_layers
    ("modernbert", dict(num_hidden_layers=3), [0, 2]),  # layer_types global, sliding, sliding -> global, sliding
])
def test_a_student_of_kept_layers_is_the_model_without_the_others(tmp_path, family, overrides, kept):
    """keep_layers' student computes what transformers' model with the other layers deleted computes, and its saved
    folder loads in transformers (config.json's layer count cut) to the same outputs."""
    import transformers

    hf = build_hf(family, "sequence-classification", **overrides)
    hf.save_pretrained(tmp_path / "model")
    model = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "model")
    student = distill.keep_layers(model, kept).eval()
    stack = next(m for m in hf.modules() if isinstance(getattr(m, "layer", getattr(m, "layers", None)),
                                                          torch.nn.ModuleList))
    name = "layer" if hasattr(stack, "layer") else "layers"
    setattr(stack, name, torch.nn.ModuleList(getattr(stack, name)[i] for i in kept))  # transformers' model, cut
    inputs = tiny_batch(family)
    with torch.no_grad():
        reference = hf(**inputs).logits
        torch.testing.assert_close(student(**inputs).logits, reference, rtol=1e-5, atol=1e-5)
        student.save_pretrained(tmp_path / "student")
        loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "student").eval()
        assert loaded.config.num_hidden_layers == len(kept)
        torch.testing.assert_close(loaded(**inputs).logits, reference, rtol=1e-5, atol=1e-5)


def test_every_other_keeps_half_and_shared_or_missing_layers_are_refused(tmp_path):
    model = hfport.AutoModelForSequenceClassification.from_config(build_hf("bert", "base", num_hidden_layers=6)
                                                                   .config.to_dict())
    assert distill.keep_layers(model, "every_other").config.num_hidden_layers == 3
    assert distill.kept_layers("every_other", 6, "m") == [0, 2, 4]
    with pytest.raises(ConfigError, match="has 6 layers"):
        distill.keep_layers(model, [0, 6])
    albert = hfport.AutoModelForSequenceClassification.from_config(build_hf("albert", "base").config.to_dict())
    with pytest.raises(ConfigError, match="one set of weights per layer"):
        distill.keep_layers(albert, [0, 2])


# --- the config and the checks before training ------------------------------------------------------------------


def test_options_and_flags(root, tmp_path):
    config, _ = resolve_config(None, {"model": "m", "train": "t", "teacher": "x", "student_layers": "0,2,4",
                                      "distill_alpha": 0.7})
    assert config.student_layers == [0, 2, 4] and config.distill_alpha == 0.7
    assert resolve_config(None, {"model": "m", "train": "t", "student_layers": "every_other"})[0].student_layers \
        == "every_other"
    with pytest.raises(ConfigError, match="increasing order"):
        resolve_config(None, {"model": "m", "train": "t", "student_layers": "2,1"})
    with pytest.raises(ConfigError, match="distill_temperature without a teacher"):
        resolve_config(None, {"model": "m", "train": "t", "distill_temperature": 4.0})
    with pytest.raises(ConfigError, match="has 2 layers"):
        preflight(_config(root, tmp_path / "run", student_layers=[0, 2]))


def test_a_student_of_an_adapter_is_refused_naming_the_merge(root, tmp_path):
    """--student-layers on a LoRA adapter folder (a LoRA run's best/) is refused before anything loads, saying to
    merge it first (it failed in keep_layers naming the base's config.json and the LoRA tensors the layers lack)."""
    adapter = tmp_path / "adapter"
    model = hfport.AutoModelForSequenceClassification.from_pretrained(root / "student")
    save_random_adapter(model, adapter, base=root / "student", seed=3, r=4, alpha=8, targets=["q", "v"])
    for name in TOKENIZER_FILES:  # as a run's best/ has them
        shutil.copy(root / "student" / name, adapter / name)
    with pytest.raises(ConfigError, match=r"student_layers: .*adapter is a LoRA adapter; .* merge it first"):
        preflight(_config(root, tmp_path / "run", model=str(adapter), student_layers="every_other"))


def test_the_finetune_command_takes_the_distillation_flags():
    from typer.testing import CliRunner

    from hfport.cli import app

    result = CliRunner().invoke(app, ["finetune", "--model", "m", "--train", "t", "--teacher", "big",
                                      "--distill-alpha", "0.8", "--distill-temperature", "4", "--teacher-dtype",
                                      "bfloat16", "--student-layers", "every_other", "--print-config"])
    assert result.exit_code == 0, result.output
    shown = {line.split()[0]: (line.split()[1], line.split()[-1]) for line in result.stdout.splitlines()}
    assert shown["teacher"] == ('"big"', "(flag)") and shown["distill_alpha"] == ("0.8", "(flag)")
    assert shown["distill_temperature"][0] == "4.0" and shown["teacher_dtype"][0] == '"bfloat16"'
    assert shown["student_layers"] == ('"every_other"', "(flag)")


def test_the_teacher_is_checked_before_training(root, tmp_path, minilm_path):
    with pytest.raises(ConfigError, match="fill-mask does not distil"):
        preflight(_config(root, tmp_path / "a", task="fill-mask"))
    with pytest.raises(ConfigError, match="a feature-extraction checkpoint"):  # a bare encoder teaching labels
        preflight(_config(root, tmp_path / "b", teacher=str(root / "student")))
    with pytest.raises(ConfigError, match="2 labels; a text-ranking student has 1"):
        preflight(_config(root, tmp_path / "c", task="text-ranking", train=str(root / "rerank.jsonl"), eval=None))
    other = tmp_path / "other_vocab"
    save_with_tokenizer("bert", "sequence-classification", other, minilm_path, vocab_size=30522, **NO_DROPOUT)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["film"], vocab["plot"] = vocab["plot"], vocab["film"]  # one vocabulary, two words' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="tokenizer differs"):
        preflight(_config(root, tmp_path / "d", teacher=str(other)))
    with pytest.raises(DataError, match=r"mixed.jsonl.*line 1.*without its own target"):
        preflight(_config(root, tmp_path / "e", train=str(root / "mixed.jsonl"), eval=str(root / "mixed.jsonl")))


def test_a_run_folder_is_its_best_model_as_model_and_teacher(root, tmp_path):
    """`--model run --teacher run --student-layers every_other` (the retrieval example's distillation step): a run
    folder stands for its best/ model, as `hfport export` and `evaluate` take it; the config records best/. A model
    folder and a repo id stay as given."""
    run = tmp_path / "teacher-run"
    shutil.copytree(root / "teacher", run / "best")
    shutil.copytree(root / "teacher", run / "final")
    (run / "summary.json").write_text("{}")
    config = _config(root, tmp_path / "student", model=str(run), teacher=str(run), student_layers="every_other")
    assert (config.model, config.teacher) == (str(run / "best"), str(run / "best"))
    checked = preflight(config)
    assert checked.source == run / "best" and checked.task.folder == run / "best"
    assert _config(root, tmp_path / "x", model="org/name").model == "org/name"
    assert _config(root, tmp_path / "y").teacher == str(root / "teacher")


def test_the_service_confines_the_teacher_as_it_confines_the_model(root, tmp_path):
    """POST /jobs/finetune: a teacher outside the allowed dirs is refused (403) as a model there is; a registered
    name or a folder inside is taken."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings
    from tests.serving import assert_error

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    config = {"model": str(root / "student"), "task": "text-classification", "train": str(root / "labelled.jsonl"),
              "eval": str(root / "eval.jsonl"), "batch_size": 8}
    with TestClient(create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[root, allowed]),
                               run_worker=False)) as c:
        assert_error(c.post("/jobs/finetune", json={"config": {**config, "teacher": "/etc"}}), 403)
        outside = tmp_path / "outside"
        shutil.copytree(root / "teacher", outside)
        (allowed / "link").symlink_to(outside, target_is_directory=True)
        for path in (outside, allowed / "link"):
            assert_error(c.post("/jobs/finetune", json={"config": {**config, "teacher": str(path)}}), 403)
        assert c.post("/models", json={"name": "big", "path": str(root / "teacher")}).status_code == 201
        r = c.post("/jobs/finetune", json={"config": {**config, "teacher": "big"}})
        assert r.status_code in (200, 201, 202), r.text
        assert r.json()["config"]["teacher"] == str(root / "teacher")
