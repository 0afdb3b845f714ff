"""The model card: README.md of every export, from one builder. It reads what the staged folder is (a
sentence-transformers layout: SentenceTransformer, SparseEncoder or CrossEncoder; else transformers), the run's
RunSummary (when SRC is a run) and the verify report of that export, and takes what only its format knows from the
format's record (CardStyle: the Hub library, tags, the relation to the base model, how to use it, a section on its
own files). In the layout the Hub renders: YAML front matter (library_name, pipeline_tag, tags, base_model, datasets
where known, model-index with the eval results), then the task, labels, base model, training data (paths, splits,
row counts), hyperparameters, hfport version, eval metrics and the verify result.

The writers call write_card last inside the staged folder, after verify ran, so the card states the outcome of the
export it sits in (a failed verify writes nothing at all)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .. import lora
from ..formats.sentence_transformers import has_embedding_layout, has_sparse_layout, is_cross_encoder
from ..formats.tables import split_read
from ..rundir import RunSummary
from ..tasks import TASKS
from ..version import __version__
from .common import PIPELINE_TAGS, TRANSFORMERS_AUTO, ExportResult, Source
from .report import VerifyReport


@dataclass(frozen=True)
class CardFacts:
    """What a format's card functions are given: the staged folder, its name (OUT's), task, config.json, the base
    model (a run's, else an adapter's; None when unknown) and the verify report (None: not verified)."""

    folder: Path
    name: str
    task: str
    config: dict[str, Any]
    base: str | None
    report: VerifyReport | None


@dataclass(frozen=True)
class CardStyle:
    """What a format's record adds to the shared card (export/registry.py: ExportFormat.card).

    library: the Hub's library_name; None: as the folder says (a sentence-transformers layout, else transformers).
    tags: added after the library's own. relation: the Hub's base_model_relation (adapter, merge), also the
    base_model:<relation>:<base> tag peft's cards carry. use: the "Use" section (None: the library's loader).
    section: the format's own section (its files), before the verify result."""

    library: str | None = None
    tags: tuple[str, ...] = ()
    relation: str | None = None
    use: Callable[[CardFacts], list[str]] | None = None
    section: Callable[[CardFacts], list[str]] | None = None


@dataclass(frozen=True)
class SentenceKind:
    """A sentence-transformers layout: how to tell it from the folder, its Hub pipeline tag and tags, its class and a
    call, and the hfport pipeline that computes the same."""

    detect: Callable[[Path, dict[str, Any]], bool]
    pipeline_tag: str
    tags: tuple[str, ...]
    cls: str
    call: str
    hfport_task: str


# the sentence-transformers layouts, asked in this order (a sparse folder has a modules.json too); tags and pipeline
# tags as sentence-transformers' own model cards write them
SENTENCE_KINDS = (
    SentenceKind(lambda folder, config: has_sparse_layout(folder), "feature-extraction",
                 ("sentence-transformers", "sparse-encoder", "sparse", "splade"), "SparseEncoder",
                 'embeddings = model.encode(["The first sentence.", "The second one."])  # sparse (N, vocab)',
                 "sparse-embedding"),
    SentenceKind(lambda folder, config: has_embedding_layout(folder), "sentence-similarity",
                 ("sentence-transformers",), "SentenceTransformer",
                 'embeddings = model.encode(["The first sentence.", "The second one."])', "sentence-embedding"),
    SentenceKind(lambda folder, config: is_cross_encoder(config), "text-ranking", ("sentence-transformers",),
                 "CrossEncoder", 'scores = model.predict([("A question?", "A passage that answers it.")])',
                 "text-ranking"),
)
PLAIN = CardStyle()  # the weight folders: the library the folder's layout says
# the hyperparameters the card's table shows (the whole config follows as JSON)
HYPERPARAMETERS = ("lr", "epochs", "max_steps", "batch_size", "grad_accum", "optimizer", "weight_decay", "scheduler",
                   "warmup_ratio", "warmup_steps", "max_grad_norm", "max_length", "precision", "seed", "lora")
VERIFY_HEADING = "## Verification"
NOT_VERIFIED = ("not verified at export; `hfport verify` proves the folder against its source (transformers loads it "
                "and computes what hfport computes)")


def repo_id(value: Any, data: bool = False) -> str | None:
    """VALUE when it names a Hub repo ("owner/name" or "name") rather than a local path: what the Hub's base_model
    and datasets fields take. data: a name with a file suffix (train.jsonl, data.parquet) is a file, not a repo."""
    if not isinstance(value, str) or not value or Path(value).expanduser().exists():
        return None
    if value.startswith((".", "/", "~")) or value.count("/") > 1 or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", value):
        return None
    return None if data and Path(value).suffix[1:].isalpha() else value


def sentence_kind(folder: Path, config: dict[str, Any], style: CardStyle) -> SentenceKind | None:
    """The sentence-transformers layout FOLDER has; None when the format names its own library (an adapter, ONNX)."""
    if style.library is not None:
        return None
    return next((k for k in SENTENCE_KINDS if k.detect(folder, config)), None)


def base_model(source: Source, folder: Path, summary: RunSummary | None) -> str | None:
    """The model SRC was fine-tuned from: the run's config, else the adapter's base (in OUT or in SRC)."""
    if summary is not None and summary.config.get("model"):
        return str(summary.config["model"])
    for where in (folder, source.model):
        if lora.is_adapter_folder(where):
            return read_json(where / lora.ADAPTER_CONFIG).get("base_model_name_or_path")
    return None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object the writer just wrote (or {} when absent or unreadable: verify names what is wrong with it)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_card(folder: Path, source: Source, result: ExportResult, style: CardStyle = PLAIN) -> None:
    """README.md in FOLDER (the staged export), with result.report's verdict (None: not verified); the writers call
    it after verify, before the folder is renamed into place, so the card and the folder appear together."""
    (folder / "README.md").write_text(model_card(folder, source, result, style), encoding="utf-8")


def model_card(folder: Path, source: Source, result: ExportResult, style: CardStyle = PLAIN) -> str:
    """The README.md text for the export in FOLDER: front matter, task, labels, base model, the format's section,
    training data, hyperparameters and eval metrics (from the run's summary.json), the verify result, how to use it."""
    config = read_json(folder / "config.json")
    summary = source.summary()
    facts = CardFacts(folder, result.out.name, result.task, config,
                      base_model(source, folder, summary), result.report)
    kind = sentence_kind(folder, config, style)
    tag = kind.pipeline_tag if kind else PIPELINE_TAGS.get(result.task)
    architecture = (config.get("architectures") or ["?"])[0]
    pipeline = (f"transformers pipeline `{PIPELINE_TAGS[result.task]}`" if result.task in PIPELINE_TAGS else
                f"no pipeline: `{TRANSFORMERS_AUTO[result.task]}` loads it")
    lines = [front_matter(facts, summary, style, kind, result.family), "", f"# {facts.name}", "",
             (f"A `{architecture}` ({result.family}, {result.task}) exported by hfport {__version__} from "
              f"`{source.model}`; weights in {result.dtype}."), "",
             "## Task", "", f"{result.task} ({pipeline})"
             + (f"; a sentence-transformers {kind.cls} model (`{tag}`)" if kind else ""), ""]
    if TASKS[result.task].labels and config.get("id2label"):
        lines += ["## Labels", "", "| id | label |", "|---:|---|"]
        lines += [f"| {i} | {label} |" for i, label in sorted(config["id2label"].items(), key=lambda kv: int(kv[0]))]
        if config.get("problem_type"):
            lines += ["", f"problem_type: `{config['problem_type']}`"]
        lines.append("")
    lines += ["## Base model", "", f"`{facts.base}`" if facts.base else
              "not recorded (no fine-tune summary.json beside SRC)", ""]
    lines += style.section(facts) if style.section is not None else []
    if summary is not None:
        lines += training_section(summary) + evaluation_section(summary)
    lines += [VERIFY_HEADING, "", *(verify_section(facts.report) if facts.report is not None else [NOT_VERIFIED, ""])]
    lines += style.use(facts) if style.use is not None else use_section(facts, kind)
    return "\n".join(lines)


def front_matter(facts: CardFacts, summary: RunSummary | None, style: CardStyle, kind: SentenceKind | None,
                 family: str) -> str:
    """The YAML block the Hub reads: library, pipeline tag, tags, base_model (+ its relation) and datasets (Hub repo
    ids only: a local path means nothing there), model-index with the last evaluation's metrics."""
    train_config = summary.config if summary is not None else {}
    tag = kind.pipeline_tag if kind else PIPELINE_TAGS.get(facts.task)  # None: a model-only head, no tag
    library = style.library or ("sentence-transformers" if kind else "transformers")
    base = repo_id(facts.base)
    tags = [*(kind.tags if kind else ()), *style.tags, "hfport", family]
    if base and style.relation:
        tags.append(f"base_model:{style.relation}:{base}")
    meta: dict[str, Any] = {"library_name": library, **({"pipeline_tag": tag} if tag else {}),
                            "tags": list(dict.fromkeys(tags))}
    if base:
        meta["base_model"] = base
        if style.relation:
            meta["base_model_relation"] = style.relation
    datasets = [d for d in dict.fromkeys(repo_id(train_config.get(k), data=True) for k in ("train", "eval")) if d]
    if datasets:
        meta["datasets"] = datasets
    metrics = [{"type": k.removeprefix("eval_"), "value": v, "name": k.removeprefix("eval_")}
               for k, v in ((summary.final_eval or {}) if summary is not None else {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if metrics:
        split = train_config.get("eval_split") or ("validation" if train_config.get("eval") else "held-out")
        data_name = train_config.get("eval") or train_config.get("train")
        meta["model-index"] = [{"name": facts.name, "results": [{
            "task": {"type": tag, "name": tag},
            "dataset": {"type": datasets[-1] if datasets else "custom", "name": Path(str(data_name)).name,
                        "split": split},
            "metrics": metrics}]}]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---"


def training_section(summary: RunSummary) -> list[str]:
    """What it was trained on (files, splits, row counts), for how long, with which hyperparameters."""
    c = summary.config
    splits = {k: split_read(c.get(k), c.get(f"{k}_split")) for k in ("train", "eval")}  # a DatasetDict folder's
    data = [f"| train | `{c.get('train')}` | {splits['train'] or '-'} | {summary.train_examples} |"]
    if c.get("eval"):
        data.append(f"| eval | `{c['eval']}` | {splits['eval'] or '-'} | {summary.eval_examples} |")
    elif summary.eval_examples:
        data.append(f"| eval | a seeded {c.get('eval_fraction')} of train (seed {c.get('seed')}) | - | "
                    f"{summary.eval_examples} |")
    hyper = [f"| {k} | `{json.dumps(c[k])}` |" for k in HYPERPARAMETERS if k in c and c[k] is not None]
    return ["## Training", "", f"{summary.steps} steps, {summary.epochs} epochs; best step {summary.best_step}"
            + (" (stopped early)" if summary.stopped_early else "") + ".", "",
            "### Data", "", "| | source | split | rows |", "|---|---|---|---:|", *data, "",
            "### Hyperparameters", "", "| option | value |", "|---|---|", *hyper, "",
            "The whole config (`hfport finetune --config` takes it back):", "",
            "```json", json.dumps(c, indent=2, sort_keys=True), "```", ""]


def evaluation_section(summary: RunSummary) -> list[str]:
    lines = ["## Evaluation", "", "The run's evaluation (summary.json) of the model this folder was exported from; "
             "Verification below says how closely the export computes the same.", ""]
    metrics = {**{f"best {k}": v for k, v in (summary.best_metric or {}).items()}, **(summary.final_eval or {})}
    if metrics:
        lines += ["| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics.items()]
    else:
        lines.append("no evaluation was run")
    return lines + [""]


def use_section(facts: CardFacts, kind: SentenceKind | None) -> list[str]:
    """How to load the folder with the library it is listed under, and with hfport."""
    name = facts.name
    if kind is not None:
        return ["## Use", "", "```python", f"from sentence_transformers import {kind.cls}", "",
                f'model = {kind.cls}("{name}")', kind.call, "```", "",
                f'With hfport: `hfport.pipeline("{kind.hfport_task}", model="{name}")`.', ""]
    auto = TRANSFORMERS_AUTO[facts.task]
    return ["## Use", "", "```python", f"from transformers import AutoTokenizer, {auto}", "",
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            f'model = {auto}.from_pretrained("{name}")', "```", ""]


def verify_section(report: VerifyReport) -> list[str]:
    """The verify result: pass or fail, the tolerances, each check with its largest difference."""
    worst = max((r.max_abs_diff for r in report.rows if r.max_abs_diff is not None), default=None)
    lines = [f"**{'PASS' if report.passed else 'FAIL'}** at export: {len(report.rows)} checks against "
             f"`{report.source}` ({report.dtype}, {report.tolerance if report.atol is not None else 'no tolerance'}"
             + (f"; largest max |diff| {worst:.3g}" if worst is not None else "") + ").", "",
             "| check | output | max abs diff | result |", "|---|---|---:|---|"]
    lines += [f"| {r.check} | {r.output} | {'' if r.max_abs_diff is None else f'{r.max_abs_diff:.3g}'} | "
              f"{'pass' if r.passed else 'FAIL'} |" for r in report.rows]
    return lines + [""]


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
