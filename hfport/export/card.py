"""The model card: README.md of an exported folder, from its config and the run's RunSummary (when SRC is a run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..tasks import TASKS
from .common import PIPELINE_TAGS, TRANSFORMERS_AUTO, Source
from ..formats.sentence_transformers import is_cross_encoder

# A folder sentence-transformers loads is listed on the Hub under its library and these pipeline tags, and used
# through its classes: (pipeline tag, class, a call)
SENTENCE_TRANSFORMERS_KINDS = {
    "embedding": ("sentence-similarity", "SentenceTransformer",
                  'embeddings = model.encode(["The first sentence.", "The second one."])'),
    "cross-encoder": ("text-ranking", "CrossEncoder",
                      'scores = model.predict([("A question?", "A passage that answers it.")])'),
}


def model_card(source: Source, config: dict[str, Any], task: str, name: str, *,
               embedding_layout: bool = False) -> str:
    """README.md: task, labels, base model, training config and eval metrics (from the run's summary.json).

    embedding_layout: the folder carries sentence-transformers' modules (an embedding model); a config with
    CrossEncoder's marker is a reranker. Both are listed as sentence-transformers models, used through its classes."""
    st_kind = "embedding" if embedding_layout else "cross-encoder" if is_cross_encoder(config) else None
    summary = source.summary()
    train_config = summary.config if summary is not None else {}
    base = train_config.get("model")
    base_is_repo = isinstance(base, str) and not Path(base).expanduser().exists() and base.count("/") <= 1 \
        and not base.startswith((".", "/", "~"))
    tag = SENTENCE_TRANSFORMERS_KINDS[st_kind][0] if st_kind else PIPELINE_TAGS[task]
    front = ["---", f"library_name: {'sentence-transformers' if st_kind else 'transformers'}", f"pipeline_tag: {tag}",
             f"tags: [{'sentence-transformers, ' if st_kind else ''}hfport, {json.dumps(config['model_type'])}]"]
    if base_is_repo:
        front.append(f"base_model: {json.dumps(base)}")
    front.append("---")
    lines = [*front, "", f"# {name}", "",
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
        lines += ["## Training", "", f"{summary.steps} steps, {summary.epochs} epochs, "
                  f"{summary.train_examples} training and {summary.eval_examples} evaluation examples; "
                  f"best step {summary.best_step}" + (" (stopped early)" if summary.stopped_early else "") + ".", "",
                  "```json", json.dumps(train_config, indent=2, sort_keys=True), "```", ""]
        lines += ["## Evaluation", ""]
        metrics = {**{f"best {k}": v for k, v in (summary.best_metric or {}).items()}, **(summary.final_eval or {})}
        if metrics:
            lines += ["| metric | value |", "|---|---:|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in metrics.items()]
        else:
            lines.append("no evaluation was run")
        lines.append("")
    if st_kind:
        _, cls, call = SENTENCE_TRANSFORMERS_KINDS[st_kind]
        lines += ["## Use", "", "```python", f"from sentence_transformers import {cls}", "",
                  f'model = {cls}("{name}")', call, "```", "",
                  "With hfport: `hfport.pipeline(" + ('"sentence-embedding"' if st_kind == "embedding"
                                                      else '"text-ranking"') + f', model="{name}")`.', ""]
        return "\n".join(lines)
    auto = TRANSFORMERS_AUTO[task]
    lines += ["## Use", "", "```python", f"from transformers import AutoTokenizer, {auto}", "",
              f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
              f'model = {auto}.from_pretrained("{name}")', "```", ""]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
