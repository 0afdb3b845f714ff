"""The model card of every export format: YAML front matter the Hub reads (huggingface_hub's ModelCard is the
judge), with the library and tags each format's own cards use (transformers, sentence-transformers' SparseEncoder /
SentenceTransformer / CrossEncoder, peft, optimum's ONNX); from a run, the training data with row counts, the
hyperparameters, hfport's version, the eval metrics; always the verify result of that export; nothing invented for a
folder without a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

import hfport
from hfport.export import FORMATS, export
from hfport.export.card import NOT_VERIFIED, PLAIN, CardFacts, front_matter
from hfport.export.peft import ADAPTER_CARD
from hfport.formats.sentence_transformers import mark_cross_encoder, write_embedding_layout, write_sparse_layout
from hfport.rundir import RunSummary
from hfport.train.loop import finetune
from tests.finetuning import sentiment_run
from tests.tiny import TOKENIZER_FILES, mlm_folder, save_hf



@pytest.fixture(scope="module")
def base(tmp_path_factory, minilm_path) -> Path:
    return sentiment_run(tmp_path_factory.mktemp("card"), minilm_path, 40, 12)


def fine_tune(root: Path, name: str, **extra) -> Path:
    """A 4-step fine-tune of the tiny BERT with an eval file."""
    finetune({"model": str(root / "model"), "train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"),
              "output_dir": str(root / name), "batch_size": 8, "max_steps": 4, "lr": 3e-3, "precision": "fp32",
              "save_strategy": "no", **extra}, progress=False)
    return root / name


@pytest.fixture(scope="module")
def run(base) -> Path:
    return fine_tune(base, "run")


@pytest.fixture(scope="module")
def lora_run(base) -> Path:
    """The same fine-tune as a LoRA adapter (best/ holds it in PEFT's format)."""
    return fine_tune(base, "lora-run", lora={"r": 4, "alpha": 8})


def split_card(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def test_card_front_matter_and_body(run, tmp_path):
    export(run, tmp_path / "out", verify=True)
    text = (tmp_path / "out" / "README.md").read_text()
    meta, body = split_card(text)
    summary = json.loads((run / "summary.json").read_text())
    accuracy = summary["final_eval"]["eval_accuracy"]

    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-classification"
    assert meta["tags"] == ["hfport", "bert"]
    assert "base_model" not in meta and "datasets" not in meta  # local paths mean nothing on the Hub
    (index,) = meta["model-index"]
    (result,) = index["results"]
    assert index["name"] == "out" and result["task"]["type"] == "text-classification"
    assert result["dataset"] == {"type": "custom", "name": "eval.jsonl", "split": "validation"}
    metrics = {m["type"]: m["value"] for m in result["metrics"]}
    assert metrics["accuracy"] == accuracy and metrics["loss"] == summary["final_eval"]["eval_loss"]

    card = ModelCard(text)  # the Hub's own parser
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    parsed = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert parsed["accuracy"] == accuracy and card.data.eval_results[0].dataset_split == "validation"

    config = summary["config"]
    assert f"| train | `{config['train']}` | - | 40 |" in body and f"| eval | `{config['eval']}` | - | 12 |" in body
    assert "| lr | `0.003` |" in body and "| batch_size | `8` |" in body and "| max_steps | `4` |" in body
    assert f"exported by hfport {hfport.__version__}" in body
    assert f"| eval_accuracy | {accuracy:.4f} |" in body
    assert "**PASS** at export" in body and "| outputs | texts/logits |" in body and NOT_VERIFIED not in body
    assert body.index("## Verification") < body.index("## Use")  # filled in where it stood


def test_card_without_verify_says_so(run, tmp_path):
    export(run, tmp_path / "out", verify=False)
    meta, body = split_card((tmp_path / "out" / "README.md").read_text())
    assert NOT_VERIFIED in body and "**PASS**" not in body and meta["model-index"]


def test_hub_ids_become_base_model_and_datasets():
    summary = RunSummary(steps=3, epochs=1, best_metric={"f1": 0.5}, best_step=3, stopped_early=False,
                         metric_mode="max", frozen=0, train_examples=10, eval_examples=0, labels=None,
                         problem_type=None, config={"model": "google-bert/bert-base-uncased",
                                                    "train": "stanfordnlp/imdb", "eval": None}, final_eval=None)
    facts = CardFacts(Path("m"), "m", "text-classification", {"model_type": "bert"}, summary.config["model"], None)
    meta = yaml.safe_load(front_matter(facts, summary, PLAIN, None, "bert").strip("-\n"))
    assert meta["base_model"] == "google-bert/bert-base-uncased" and meta["datasets"] == ["stanfordnlp/imdb"]
    assert "model-index" not in meta and "base_model_relation" not in meta  # no evaluation ran: no results
    # an adapter's card, as peft writes it: library peft, the base, the adapter relation and peft's base tag
    meta = yaml.safe_load(front_matter(facts, summary, ADAPTER_CARD, None, "bert").strip("-\n"))
    assert meta["library_name"] == "peft" and meta["base_model_relation"] == "adapter"
    assert "base_model:adapter:google-bert/bert-base-uncased" in meta["tags"] and "lora" in meta["tags"]
    summary.config["train"] = "no/such/train.jsonl"
    facts = CardFacts(Path("m"), "m", "fill-mask", {"model_type": "bert"}, "./local/base", None)
    meta = yaml.safe_load(front_matter(facts, summary, PLAIN, None, "bert").strip("-\n"))
    assert "datasets" not in meta and "base_model" not in meta


@pytest.fixture(scope="module")
def plain_sources(tmp_path_factory, minilm_path) -> dict[str, Path]:
    """Folders without a run, one in each sentence-transformers layout (the real MiniLM tokenizer beside each)."""
    root = tmp_path_factory.mktemp("card-plain")
    made = {"sentence-transformers": root / "st", "cross-encoder": root / "reranker", "hf": root / "hf"}
    model = save_hf("bert", "base", made["sentence-transformers"], vocab_size=30522)
    write_embedding_layout(made["sentence-transformers"], pooling="mean", normalize=True,
                           hidden_size=model.config.hidden_size, max_seq_length=128)
    save_hf("bert", "sequence-classification", made["cross-encoder"], vocab_size=30522, num_labels=1)
    mark_cross_encoder(made["cross-encoder"])
    save_hf("bert", "token-classification", made["hf"], vocab_size=30522)
    for folder in made.values():
        for f in TOKENIZER_FILES:
            shutil.copy(minilm_path / f, folder / f)
    made["sparse-encoder"] = mlm_folder(root / "sparse", minilm_path)
    write_sparse_layout(made["sparse-encoder"], max_seq_length=128)
    return made


# format -> (the source: a run, its LoRA twin or a plain folder; library_name; pipeline_tag; tags its cards carry)
EXPECTED = {
    "hf": ("run", "transformers", "text-classification", {"hfport", "bert"}),
    "onnx": ("run", "transformers", "text-classification", {"onnx"}),
    "onnx-int8": ("run", "transformers", "text-classification", {"onnx"}),
    "openvino": ("run", "transformers", "text-classification", {"openvino"}),
    "openvino-int8": ("run", "transformers", "text-classification", {"openvino"}),
    "peft": ("lora_run", "peft", "text-classification", {"lora"}),
    "merged": ("lora_run", "transformers", "text-classification", set()),
    "sentence-transformers": ("plain", "sentence-transformers", "sentence-similarity", {"sentence-transformers"}),
    "cross-encoder": ("plain", "sentence-transformers", "text-ranking", {"sentence-transformers"}),
    "sparse-encoder": ("plain", "sentence-transformers", "feature-extraction",
                       {"sentence-transformers", "sparse-encoder", "sparse", "splade"}),
}


def test_every_format_has_a_card_test():
    assert set(EXPECTED) == set(FORMATS)


@pytest.mark.parametrize("fmt", list(EXPECTED))
def test_every_format_writes_a_card_the_hub_reads(fmt, request, plain_sources, tmp_path):
    """Each format's export carries README.md: its front matter parses (yaml and huggingface_hub's ModelCard) with
    the library, pipeline tag and tags that library's own cards use; from a run it names the data with row counts,
    the hyperparameters and the eval metrics; it states that export's verify result; without a run it claims no
    data, base model or results."""
    origin, library, tag, tags = EXPECTED[fmt]
    src = plain_sources[fmt] if origin == "plain" else request.getfixturevalue(origin)
    result = export(src, tmp_path / "out", format=fmt, verify=True)
    assert result.report.passed and "README.md" in result.files
    path = tmp_path / "out" / "README.md"
    meta, body = split_card(path.read_text())
    assert meta["library_name"] == library and meta["pipeline_tag"] == tag and tags <= set(meta["tags"])
    card = ModelCard.load(path)  # the Hub's own reader, on the file (offline)
    assert card.data.library_name == library and card.data.pipeline_tag == tag
    assert f"exported by hfport {hfport.__version__}" in body
    assert "**PASS** at export" in body and NOT_VERIFIED not in body
    if origin == "plain":
        assert not {"model-index", "datasets", "base_model"} & set(meta)  # nothing to claim
        assert "## Training" not in body and "## Evaluation" not in body and "not recorded" in body
        return
    summary = json.loads((src / "summary.json").read_text())
    config, final = summary["config"], summary["final_eval"]
    assert f"| train | `{config['train']}` | - | 40 |" in body and f"| eval | `{config['eval']}` | - | 12 |" in body
    assert "| lr | `0.003` |" in body and "| max_steps | `4` |" in body
    assert f"| eval_accuracy | {final['eval_accuracy']:.4f} |" in body
    parsed = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert parsed["accuracy"] == final["eval_accuracy"]
    assert f"`{config['model']}`" in body  # the base model, named in the body (a local path: not in the YAML)


def test_onnx_card_names_the_int8_graph_and_the_gate(run, tmp_path):
    """The onnx-int8 card says which file is the int8 graph and what the gate measured (its rows of the verify
    report); optimum's class loads it by that file name."""
    result = export(run, tmp_path / "out", format="onnx-int8")
    _, body = split_card((tmp_path / "out" / "README.md").read_text())
    assert "`model_quantized.onnx` is the int8 graph" in body and 'file_name="model_quantized.onnx"' in body
    assert "from optimum.onnxruntime import ORTModelForSequenceClassification" in body
    gate = [r for r in result.report.rows if r.check == "int8 vs fp32"]
    assert gate and all(f"| {r.output} | {r.shape} | {r.tolerance} | pass |" in body for r in gate)


def test_adapter_card_names_the_adapter_and_its_base(lora_run, tmp_path):
    export(lora_run, tmp_path / "out", format="peft")  # not verified: the card says so
    _, body = split_card((tmp_path / "out" / "README.md").read_text())
    base = json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert "| r | `4` |" in body and "| lora_alpha | `8" in body and f"over `{base}`" in body
    assert 'PeftModel.from_pretrained(base, "out")' in body and NOT_VERIFIED in body
    # peft reads the card back when it saves into the folder (create_or_update_model_card) and keeps what it says
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out = str(tmp_path / "out")
    model = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(
        base, config=AutoConfig.from_pretrained(out)), out)
    model.save_pretrained(out)
    meta, after = split_card((tmp_path / "out" / "README.md").read_text())
    assert meta["library_name"] == "peft" and meta["model-index"] and "lora" in meta["tags"]
    assert "## Adapter" in after and "## Training" in after and NOT_VERIFIED in after


def test_plain_folder_without_run_claims_nothing(plain_sources, tmp_path):
    """A plain HF folder that belongs to no run, exported without verify: the card still parses and names the
    head's labels, but names no data, base model or results, and says it was not verified."""
    export(plain_sources["hf"], tmp_path / "out")
    path = tmp_path / "out" / "README.md"
    meta, body = split_card(path.read_text())
    assert meta == {"library_name": "transformers", "pipeline_tag": "token-classification", "tags": ["hfport", "bert"]}
    assert ModelCard.load(path).data.eval_results is None
    assert "## Labels" in body and "not recorded" in body and NOT_VERIFIED in body
    assert "## Training" not in body and "## Evaluation" not in body and "**PASS**" not in body
