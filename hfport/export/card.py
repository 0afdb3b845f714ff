"""The model card: README.md of an exported folder, from its config and the run's RunSummary (when SRC is a run), in
the layout the Hub renders: YAML front matter (library_name, pipeline_tag, base_model, datasets where known,
model-index with the eval results), then the task, labels, training data (paths, splits, row counts),
hyperparameters, hfport version, eval metrics and the verify result (record_verify fills it in once verify ran)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from ..formats.sentence_transformers import is_cross_encoder
from ..formats.tables import split_read
from ..rundir import RunSummary
from ..tasks import TASKS
from .common import PIPELINE_TAGS, TRANSFORMERS_AUTO, Source
from .report import VerifyReport

# A folder sentence-transformers loads is listed on the Hub under its library and these pipeline tags, and used
# through its classes: (pipeline tag, class, a call)
SENTENCE_TRANSFORMERS_KINDS = {
    "embedding": ("sentence-similarity", "SentenceTransformer",
                  'embeddings = model.encode(["The first sentence.", "The second one."])'),
    "cross-encoder": ("text-ranking", "CrossEncoder",
                      'scores = model.predict([("A question?", "A passage that answers it.")])'),
}
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


def model_card(source: Source, config: dict[str, Any], task: str, name: str, *,
               embedding_layout: bool = False) -> str:
    """README.md: front matter, task, labels, base model, training data, hyperparameters and eval metrics (from the
    run's summary.json), the verify section (filled in by record_verify), how to use it.

    embedding_layout: the folder carries sentence-transformers' modules (an embedding model); a config with
    CrossEncoder's marker is a reranker. Both are listed as sentence-transformers models, used through its classes."""
    st_kind = "embedding" if embedding_layout else "cross-encoder" if is_cross_encoder(config) else None
    summary = source.summary()
    train_config = summary.config if summary is not None else {}
    base = train_config.get("model")
    tag = SENTENCE_TRANSFORMERS_KINDS[st_kind][0] if st_kind else PIPELINE_TAGS[task]
    lines = [front_matter(config, summary, name, tag, st_kind), "", f"# {name}", "",
             (f"A `{config['architectures'][0]}` ({config['model_type']}, {task}) exported by hfport "
              f"{config.get('hfport_version')} from `{source.model}`; weights in {config['dtype']}."), "",
             "## Task", "", f"{task} (transformers pipeline `{PIPELINE_TAGS[task]}`)"
             + (f"; a sentence-transformers {st_kind} model (`{tag}`)" if st_kind else ""), ""]
    if TASKS[task].labels:
        lines += ["## Labels", "", "| id | label |", "|---:|---|"]
        lines += [f"| {i} | {label} |" for i, label in sorted(config["id2label"].items(), key=lambda kv: int(kv[0]))]
        if config.get("problem_type"):
            lines += ["", f"problem_type: `{config['problem_type']}`"]
        lines.append("")
    lines += ["## Base model", "", f"`{base}`" if base else "not recorded (no fine-tune summary.json beside SRC)", ""]
    if summary is not None:
        lines += training_section(summary) + evaluation_section(summary)
    lines += [VERIFY_HEADING, "", NOT_VERIFIED, ""] + use_section(task, name, st_kind)
    return "\n".join(lines)


def front_matter(config: dict[str, Any], summary: RunSummary | None, name: str, tag: str,
                 st_kind: str | None) -> str:
    """The YAML block the Hub reads: library, pipeline tag, tags, base_model and datasets (Hub repo ids only: a
    local path means nothing there), model-index with the last evaluation's metrics."""
    train_config = summary.config if summary is not None else {}
    meta: dict[str, Any] = {"library_name": "sentence-transformers" if st_kind else "transformers",
                            "pipeline_tag": tag,
                            "tags": (["sentence-transformers"] if st_kind else []) + ["hfport", config["model_type"]]}
    if base := repo_id(train_config.get("model")):
        meta["base_model"] = base
    datasets = [d for d in dict.fromkeys(repo_id(train_config.get(k), data=True) for k in ("train", "eval")) if d]
    if datasets:
        meta["datasets"] = datasets
    metrics = [{"type": k.removeprefix("eval_"), "value": v, "name": k.removeprefix("eval_")}
               for k, v in ((summary.final_eval or {}) if summary is not None else {}).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if metrics:
        split = train_config.get("eval_split") or ("validation" if train_config.get("eval") else "held-out")
        data_name = train_config.get("eval") or train_config.get("train")
        meta["model-index"] = [{"name": name, "results": [{
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
    lines = ["## Evaluation", ""]
    metrics = {**{f"best {k}": v for k, v in (summary.best_metric or {}).items()}, **(summary.final_eval or {})}
    if metrics:
        lines += ["| metric | value |", "|---|---:|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics.items()]
    else:
        lines.append("no evaluation was run")
    return lines + [""]


def use_section(task: str, name: str, st_kind: str | None) -> list[str]:
    if st_kind:
        _, cls, call = SENTENCE_TRANSFORMERS_KINDS[st_kind]
        return ["## Use", "", "```python", f"from sentence_transformers import {cls}", "",
                f'model = {cls}("{name}")', call, "```", "",
                "With hfport: `hfport.pipeline(" + ('"sentence-embedding"' if st_kind == "embedding"
                                                    else '"text-ranking"') + f', model="{name}")`.', ""]
    auto = TRANSFORMERS_AUTO[task]
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


def record_verify(folder: Path, report: VerifyReport) -> None:
    """Put REPORT into FOLDER's README.md (its Verification section): the writers call it once verify passed,
    before the folder appears."""
    path = Path(folder) / "README.md"
    text = path.read_text(encoding="utf-8")
    start = text.index(VERIFY_HEADING)
    end = text.find("\n## ", start + len(VERIFY_HEADING))
    body = "\n".join([VERIFY_HEADING, "", *verify_section(report)])
    path.write_text(text[:start] + body + (text[end:] if end >= 0 else "\n"), encoding="utf-8")


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
