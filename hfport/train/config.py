"""FinetuneConfig: every knob of a fine-tuning run, validated; flags override a YAML/JSON file."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from .. import tasks
from ..errors import ConfigError
from ..rundir import RunDir
from .aliases import did_you_mean, translate
from .data import MEGA_BUCKET_STEPS
from .trackers import report_to_list

# the mode of a metric named without --metric-mode: min for these and, as transformers' greater_is_better default, for
# any name ending in "loss"; transformers would maximise mse, mae and perplexity (every name not ending in "loss"),
# which keeps the worst model: hfport minimises them
LOWER_IS_BETTER = ("loss", "mse", "mae", "perplexity")
TRANSFORMERS_SAVE_STEPS = 500  # TrainingArguments' save_steps, what save_strategy "steps" uses when none is given
# the plateau schedules' (factor, patience) where plateau_factor / plateau_patience are not given: hfport's plateau
# (cut by half after one stalled evaluation: evaluations are few, one an epoch by default) and transformers'
# reduce_lr_on_plateau (torch's ReduceLROnPlateau defaults)
PLATEAU_DEFAULTS = {"plateau": (0.5, 1), "reduce_lr_on_plateau": (0.1, 10)}
NO_WARMUP = ("constant", "reduce_lr_on_plateau")  # transformers' schedules that never warm up


def comma_list(annotation: Any, value: Any) -> Any:
    """A string given for a list or tuple field (a flag, --set, an HTTP job body) as the list of its comma-separated
    parts, each field's type then checking and converting them: `--set matryoshka_dims=32,16` as `freeze=a,b`. A
    string the field also takes whole (a Literal beside the list: class_weights' "balanced") stays as it is."""
    if not isinstance(value, str):
        return value
    kinds = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    if not any(get_origin(k) in (list, tuple) for k in kinds):
        return value
    if any(value in get_args(k) for k in kinds if get_origin(k) is Literal):
        return value
    return [p.strip() for p in value.split(",") if p.strip()]


class LoraSettings(BaseModel):
    """LoRA: train low-rank updates of the target layers and the task head in full; the rest stays frozen. best/
    and final/ then hold the adapter in PEFT's format (hfport/lora.py)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, description="rank of the update B A")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / r")
    dropout: float = Field(0.1, ge=0, lt=1, description="dropout on the input of A")
    target_modules: list[str] | None = Field(None, description=(
        "the layers to adapt, in hfport names (attn.q, ffn.up) or HF names (query, value, attention.output.dense, "
        "or a full path); default the attention's query and value projections"))
    use_rslora: bool = Field(False, description="scale by alpha / sqrt(r) (rank-stabilised LoRA)")

    @field_validator("*", mode="before")
    @classmethod
    def _split(cls, v: Any, info: ValidationInfo) -> Any:
        return comma_list(cls.model_fields[info.field_name].annotation, v)


class FinetuneConfig(BaseModel):
    """One run. Field names are the CLI flags with dashes turned into underscores."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # what and where
    model: str = Field(description="model folder, repo id in the local HF cache, or fine-tune run folder (its best/)")
    task: str = Field("text-classification", description=(
        f"the task, by transformers' pipeline tag or an alias: {tasks.names_help(trainable_only=True)}; "
        "aliases are stored as the canonical name"))
    train: str = Field(description=(
        "training data: a CSV/TSV, JSONL, Parquet or Arrow file, a glob of Parquet/Arrow files, or a folder written by "
        "datasets' save_to_disk"))
    eval: str | None = Field(None, description="evaluation data (as train); else a seeded eval_fraction of train")
    train_split: str = Field("train", description="the split of a DatasetDict folder (save_to_disk) to train on")
    eval_split: str = Field("validation", description="the split of a DatasetDict folder eval names")
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description=(
        "without eval: the seeded fraction of train held out for evaluation"))
    output_dir: str = Field("hfport-run", description="where the run goes (checkpoints, best/, final/, metrics.jsonl)")
    overwrite: bool = Field(False, description="replace a run already in output_dir")
    resume: str | None = Field(None, description="'latest' or a checkpoint folder")
    # data
    text_column: str = Field("text", description="the column of the text (a pair's first text)")
    text_pair_column: str | None = Field(None, description="the column of a pair's second text; none: single texts")
    label_column: str = Field("label", description=(
        "the column of the label (a name, a number, or a list of names for multi-label)"))
    problem_type: Literal["single_label_classification", "multi_label_classification", "regression"] | None = Field(
        None, description="default: read off the labels (one name, a list of names, or numbers)")
    max_length: int = Field(256, ge=8, description="tokens per example; longer ones are cut (unset: 256, or the "
                            "model's positions where it holds fewer)")
    # token classification
    tokens_column: str = Field("tokens", description="token classification: the column of the words")
    tags_column: str = Field("tags", description="token classification: the column of the words' tags")
    label_all_subtokens: bool = Field(False, description="label every sub-token of a word, not only the first")
    # question answering
    question_column: str = Field("question", description="question answering: the column of the question")
    context_column: str = Field("context", description="question answering: the column of the context")
    answers_column: str = Field("answers", description=(
        "question answering: the column of the answers (SQuAD's {text, answer_start})"))
    # multiple choice (also question_column or context_column, and label_column: the index of the right choice)
    choices_column: str = Field("choices", description="multiple choice: the column of the choices (a list of texts; "
                                "CSV: a JSON list in the cell)")
    doc_stride: int = Field(128, ge=0, description="tokens shared by consecutive windows of a long context")
    max_answer_length: int = Field(30, ge=1, description="longest answer span (tokens) evaluation may pick")
    # sentence embeddings (sentence-embedding) and rerankers (text-ranking)
    anchor_column: str = Field("anchor", description="embedding pairs/triplets: the query or anchor text")
    positive_column: str = Field("positive", description="the text relevant to the anchor (query)")
    negative_column: str = Field("negative", description="embedding triplets: a hard negative (a text or a list)")
    sentence1_column: str = Field("sentence1", description="scored embedding pairs: the first text")
    sentence2_column: str = Field("sentence2", description="scored embedding pairs: the second text")
    score_column: str = Field("score", description="scored embedding pairs: the similarity score")
    query_column: str = Field("query", description="reranker rows and groups: the query (rows also take "
                              "text_column and label_column)")
    negatives_column: str = Field("negatives", description="reranker groups: the list of non-relevant texts")
    score_range: tuple[float, float] = Field((0.0, 1.0), description=(
        "the declared range of scores and labels (CoSENT pairs, reranker labels): a value outside is an error; "
        "a reranker label above the low end counts as relevant"))
    loss: Literal["mnrl", "cosent", "bce", "listwise"] | None = Field(None, description=(
        "sentence-embedding: mnrl (in-batch negatives, for pairs/triplets; the default) or cosent (scored pairs; "
        "the default for them); text-ranking: bce (the default) or listwise (softmax cross-entropy over a query's "
        "candidates)"))
    scale: float | None = Field(None, gt=0, description=(
        "similarity scale of mnrl/cosent (1 / temperature); default 20 for sentence-embedding (cosine), 1 for "
        "sparse-embedding (dot product of the sparse vectors), sentence-transformers' defaults"))
    pooling: Literal["mean", "cls", "max"] | None = Field(None, description=(
        "sentence-embedding pooling; default: the base model's sentence-transformers config, else mean"))
    normalize: bool | None = Field(None, description=(
        "L2-normalise the embeddings (a Normalize module in the export); default: as the base model's "
        "sentence-transformers config, else false"))
    mini_batch_size: int | None = Field(None, ge=1, description=(
        "sentence-embedding: GradCache-style big batches; embed the batch in chunks of this many texts without "
        "keeping their activations, take the loss over the whole batch, then recompute each chunk with its "
        "embeddings' gradient (all in-batch negatives, a chunk's activation memory)"))
    gather_across_devices: bool = Field(False, description=(
        "sentence-embedding (mnrl) and sparse-embedding, several processes: score each anchor against every "
        "process's texts (the global batch's negatives, as one process with the whole batch; sparse: the FLOPS "
        "regularizers over the global batch too), gradients flowing back to each process's own rows; off: each "
        "process scores its own batch's negatives (sentence-transformers' option of the same name)"))
    matryoshka_dims: list[int] | None = Field(None, description=(
        "sentence-embedding: Matryoshka training (sentence-transformers' MatryoshkaLoss): the loss is summed over "
        "the embeddings' first n values, renormalized, for each n here (each at most the hidden size); evaluation "
        "reports each; the export records them"))
    matryoshka_weights: list[float] | None = Field(None, description=(
        "one weight per matryoshka_dims entry (default: 1 each)"))
    # sparse embeddings (SPLADE, sentence-transformers' SpladeLoss)
    query_regularizer_weight: float = Field(5e-5, ge=0, description=(
        "sparse-embedding: weight of the FLOPS regularizer on the queries (anchors)"))
    document_regularizer_weight: float = Field(3e-5, ge=0, description=(
        "sparse-embedding: weight of the FLOPS regularizer on the documents (positives and negatives)"))
    # distillation (hfport/train/distill.py)
    teacher: str | None = Field(None, description=(
        "distil from this model (a folder, repo id in the local HF cache or run folder (its best/): a checkpoint of "
        "the task's model with the student's tokenizer): its outputs for the training rows are computed once before "
        "training (cached like encoded data) and the student learns them: text- and token-classification its "
        "temperature-scaled logits (KL), rows without a label from the teacher alone; sentence-embedding its "
        "embeddings (MSE; through a learned projection, used in training only, when the widths differ) or, for "
        "(anchor, positive, negative) rows, its dot-product score margins (MarginMSE); text-ranking its scores (MSE "
        "on the logits)"))
    distill_alpha: float = Field(0.5, ge=0, le=1, description=(
        "with a teacher: alpha * the distillation loss + (1 - alpha) * the task's own loss, on rows that have their "
        "own target (1: the teacher alone, as sentence-transformers' MSELoss and MarginMSELoss; 0: the task's loss "
        "alone)"))
    distill_temperature: float = Field(2.0, gt=0, description=(
        "with a teacher: the temperature T both logits are divided by before the softmax (classification); the KL "
        "term is scaled by T^2 (Hinton et al., DistilBERT)"))
    teacher_dtype: Literal["float32", "bfloat16", "int8"] = Field("float32", description=(
        "the dtype the teacher runs in while its outputs are computed (int8: behind hfport's int8 gate)"))
    student_layers: list[int] | Literal["every_other"] | None = Field(None, description=(
        "build the model to train from `model` by keeping these encoder layers (indices from 0, increasing), or "
        "every_other (0, 2, 4, ...: half the depth, DistilBERT's recipe); its config.json's layer count follows, so "
        "best/ and final/ load as they are in transformers"))
    # masked LM
    mlm_probability: float = Field(0.15, gt=0, lt=1, description="fraction of tokens chosen for masking")
    # schedule
    epochs: float = Field(3.0, gt=0, description="passes over the training data (a fraction is allowed)")
    max_steps: int | None = Field(None, ge=1, description=(
        "optimizer steps; overrides epochs (0 or below, as transformers' default -1: epochs decide)"))
    batch_size: int = Field(16, ge=1, description="examples per optimizer step per process, before accumulation")
    grad_accum: int = Field(1, ge=1, description="batches whose gradients add up to one optimizer step")
    group_by_length: bool = Field(True, description=(
        "batch examples of similar length together (less padding, faster steps): the epoch is shuffled, cut into "
        f"groups of {MEGA_BUCKET_STEPS} steps' worth of examples, each sorted by length and cut into batches, and "
        "the order of the steps is shuffled. Which examples share a batch is then less random (neighbours in "
        "length); the order of batches stays random. Evaluation batches are sorted by length too. false: "
        "shuffled fixed-size batches"))
    max_batch_tokens: int | None = Field(None, ge=1, description=(
        "token budget per batch per process, counted as padded tokens (examples x the longest in the batch); "
        "batch_size still caps the examples. Batches of short examples get more of them, so the number of steps "
        "per epoch varies with the shuffle; a single longer example still forms its own batch"))
    # optimisation
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="AdamW or SGD")
    lr: float = Field(5e-5, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay (none on biases and LayerNorm weights)")
    momentum: float = Field(0.9, ge=0, description="SGD only")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas")
    adam_eps: float = Field(1e-8, description="AdamW's epsilon")
    layer_lr_decay: float = Field(1.0, gt=0, le=1.0, description="lr multiplier per layer going down the stack")
    scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup", "one_cycle", "plateau",
                       "reduce_lr_on_plateau"] = Field("linear", description=(
        "the learning-rate schedule, transformers' names and curves: linear or cosine (warmup from 0, then down to "
        "0), constant (no warmup), constant_with_warmup, reduce_lr_on_plateau (no warmup; the lr times "
        "plateau_factor, default 0.1, after plateau_patience, default 10, evaluations without a relative "
        "improvement of 1e-4, torch's ReduceLROnPlateau); hfport's own: one_cycle, and plateau (reduce_lr_on_plateau "
        "with warmup, factor 0.5 and patience 1 by default)"))
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description=(
        "the fraction of the steps over which the learning rate warms up (linearly from 0)"))
    warmup_steps: float = Field(0, ge=0, description=(
        "steps of warmup; overrides warmup_ratio when > 0. Below 1, a fraction of the steps (transformers 5's "
        "meaning)"))
    plateau_factor: float | None = Field(None, gt=0, lt=1, description=(
        "plateau schedules: the lr is multiplied by this when the metric stalls (default 0.5 for plateau, 0.1 for "
        "reduce_lr_on_plateau)"))
    plateau_patience: int | None = Field(None, ge=0, description=(
        "plateau schedules: evaluations without improvement before the lr is cut (default 1 for plateau, 10 for "
        "reduce_lr_on_plateau)"))
    max_grad_norm: float | None = Field(1.0, gt=0, description=(
        "clip the gradient norm to this; null or 0 (transformers' way to say it): no clipping"))
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="label smoothing of the classification loss")
    class_weights: list[float] | Literal["balanced"] | None = Field(None, description=(
        "classification loss weights: one per label, or 'balanced' (n_examples / (n_classes * count))"))
    freeze: list[str] = Field(default_factory=list, description="parameter-name prefixes to freeze")
    lora: LoraSettings | None = Field(None, description="train a LoRA adapter instead of every weight ({} or true "
                                      "for the defaults)")
    gradient_checkpointing: bool = Field(False, description="recompute each encoder layer's activations in the "
                                         "backward pass: less memory, about a third more compute")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description=(
        "mixed precision of the forward pass (weights and optimizer state stay fp32; the loss is fp32). auto: bf16 "
        "on GPUs that support it, else fp16 with loss scaling; on the CPU bf16 autocast where a timed matmul shows "
        "bf16 native (`hfport info --hardware`), else fp32. bf16 forced on a CPU without it runs (slower, with a "
        "warning); fp16 needs a CUDA GPU; fp32 forces fp32"))
    compile: bool = Field(False, description="torch.compile the model (dynamic shapes) through accelerate: the "
                          "first steps pay for compilation, later steps may run faster")
    fused_optimizer: Literal["auto", "on", "off"] = Field("auto", description=(
        "AdamW's fused kernel: auto uses it when every trained parameter is on the CPU or on CUDA (the same "
        "update to float rounding, several times faster); on insists (an error elsewhere); off never"))
    # evaluation, checkpoints, logging
    eval_strategy: Literal["epoch", "steps", "no"] = Field("epoch", description=(
        "when to evaluate: every epoch, every eval_steps, or never"))
    eval_steps: int | None = Field(None, ge=1, description=(
        "evaluate every this many optimizer steps (eval_strategy 'steps')"))
    eval_before: bool = Field(False, description=(
        "evaluate the base model before the first step: its figures are the eval line of step 0 (never best/) and "
        "report.html's 'before' column"))
    metric: str | None = Field(None, description="metric that picks the best model; default by task and "
                               "problem type (the task's record: e.g. accuracy, f1_micro for multi-label, mse for "
                               "regression, f1 for tokens and QA, perplexity for fill-mask); loss with "
                               "reduce_lr_on_plateau or load_best_model_at_end, as transformers")
    metric_mode: Literal["max", "min"] | None = Field(None, description=(
        "whether a higher (max) or lower (min) metric is better; default by the metric (min for loss, mse, mae, "
        "perplexity); needs the metric named"))
    early_stopping_patience: int | None = Field(None, ge=1, description=(
        "stop after this many evaluations without improvement of the metric"))
    early_stopping_threshold: float = Field(0.0, ge=0, description=(
        "the least change of the metric that counts as an improvement"))
    converged_window: int | None = Field(None, ge=2, description="stop once the last N evals of the metric "
                                         "span at most converged_tolerance")
    converged_tolerance: float = Field(1e-4, ge=0, description="see converged_window")
    save_strategy: Literal["epoch", "steps", "no"] = Field("epoch", description=(
        "when to write a checkpoint (model, optimizer and RNG state, what exact resume needs): epoch (every epoch "
        "end, and every save_steps when given), steps (every save_steps only) or no (none: best/ and final/ are "
        "still written, but the run cannot be resumed)"))
    save_steps: int | None = Field(None, ge=1, description="write a checkpoint every this many optimizer steps")
    save_total_limit: int = Field(2, ge=1, description="checkpoints kept on disk (the oldest go; the best one stays)")
    logging_steps: int = Field(10, ge=1, description="log the training loss every this many optimizer steps")
    report_to: list[str] = Field(default_factory=list, description=(
        "experiment trackers that receive the train/eval/perf lines and the config (transformers' option): "
        "tensorboard, mlflow, wandb (a list or comma-separated), 'all' (every one installed) or 'none'; files go "
        "under output_dir (runs/, mlruns/, wandb/; wandb offline unless WANDB_MODE says otherwise)"))
    logging_dir: str | None = Field(None, description="TensorBoard's folder; default <output_dir>/runs")
    run_name: str | None = Field(None, description="the run's name in the trackers; default output_dir's name")
    seed: int = Field(42, description=(
        "seed of the data order, the held-out split, dropout and new heads' initialisation"))

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        """transformers' TrainingArguments names (learning_rate, num_train_epochs...) stored under hfport's (an HTTP
        job body comes this way); an unknown key is left to extra="forbid" (did_you_mean words its message). Then
        the defaults transformers derives from other options (TrainingArguments.__post_init__)."""
        if not isinstance(data, dict):
            return data
        data = translate(data, cls.model_fields, keep_unknown=True)
        if data.get("eval_strategy") == "steps" and data.get("eval_steps") in (None, 0):
            data["eval_steps"] = data.get("logging_steps", cls.model_fields["logging_steps"].default)
        if data.get("save_strategy") == "steps" and data.get("save_steps") is None:
            data["save_steps"] = TRANSFORMERS_SAVE_STEPS
        return data

    @field_validator("model", "teacher")
    @classmethod
    def _run_folder(cls, v: str | None) -> str | None:
        # a fine-tune's output folder stands for its best/ model (as export and evaluate take it): `--model run
        # --teacher run --student-layers every_other` distils the model that run made; the config records best/
        return None if v is None else str(RunDir.model_folder(v))

    @field_validator("max_steps", mode="before")
    @classmethod
    def _max_steps(cls, v: Any) -> Any:
        # transformers' max_steps: -1 (its default) or any value <= 0 leaves the epochs in charge
        return None if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 else v

    @field_validator("max_grad_norm", mode="before")
    @classmethod
    def _max_grad_norm(cls, v: Any) -> Any:
        return None if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0 else v  # transformers': off

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_steps(cls, v: float) -> float:
        if v >= 1 and not float(v).is_integer():
            raise ValueError(f"{v}: a whole number of steps, or a fraction of the steps below 1")
        return int(v) if v >= 1 else v

    @classmethod
    def did_you_mean(cls, key: str) -> str:
        """"did you mean lr (transformers: learning_rate)?": the closest options to an unknown key."""
        return did_you_mean(key, cls.model_fields)

    @field_validator("task", mode="before")
    @classmethod
    def _task(cls, v: Any) -> Any:
        record = tasks.get(v)  # an unknown name lists the valid ones
        if record.train is None:
            raise ValueError(f"{record.name} cannot be fine-tuned; fine-tuning tasks: "
                             f"{tasks.names_help(trainable_only=True)}")
        return record.name

    @field_validator("lora", mode="before")
    @classmethod
    def _lora(cls, v: Any) -> Any:
        return {} if v is True else None if v is False else v

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v: Any) -> Any:
        return report_to_list(v)  # "all" expands to the trackers installed; a missing package says what to install

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, v: str | None) -> str | None:
        if v is not None and (v in ("", ".", "..") or "/" in v or "\\" in v):
            raise ValueError(f"{v!r}: a run name names TensorBoard's folder for the run; no path separators")
        return v

    @field_validator("student_layers")
    @classmethod
    def _increasing(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or v[0] < 0 or any(b <= a for a, b in zip(v, v[1:]))):
            raise ValueError(f"{v}: distinct layer indices from 0, in increasing order (the order they run in)")
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _split(cls, v: Any, info: ValidationInfo) -> Any:
        # every list field takes a comma list ("0,2,4", "32,16", "embeddings.,pooler."), as transformers' flags do
        return comma_list(cls.model_fields[info.field_name].annotation, v)

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        if self.scheduler in NO_WARMUP and (self.warmup_steps or self.warmup_ratio):
            # transformers ignores the warmup here; hfport refuses rather than drop what was asked for
            other = "constant_with_warmup" if self.scheduler == "constant" else "plateau (hfport's, with warmup)"
            raise ValueError(f"scheduler {self.scheduler!r} has no warmup (transformers' schedule of that name "
                             f"ignores warmup_steps/warmup_ratio); for a warmup use {other}")
        if self.scheduler in PLATEAU_DEFAULTS and self.eval_strategy == "no":
            raise ValueError(f"scheduler {self.scheduler!r} cuts the lr when the evaluated metric stalls; it needs an "
                             "eval_strategy other than 'no'")
        stops = [name for name in ("early_stopping_patience", "converged_window") if getattr(self, name) is not None]
        if stops and self.eval_strategy == "no":  # transformers' EarlyStoppingCallback refuses it too
            raise ValueError(f"{' and '.join(stops)}: stops the run by the evaluated metric, but eval_strategy 'no' "
                             "never evaluates; set eval_strategy to epoch or steps, or drop it")
        if self.metric_mode is not None and self.metric is None and self.scheduler != "reduce_lr_on_plateau":
            # transformers ignores greater_is_better without a metric (nothing picks a best model); applied to the
            # task's default metric it could keep the worst model (accuracy minimised)
            raise ValueError(f"metric_mode {self.metric_mode!r} (transformers: greater_is_better) without a metric: "
                             "name the metric it applies to (metric, or transformers' metric_for_best_model; "
                             "load_best_model_at_end alone picks the eval loss)")
        if self.matryoshka_dims is not None:
            if not self.matryoshka_dims or any(d < 1 for d in self.matryoshka_dims) \
                    or len(set(self.matryoshka_dims)) != len(self.matryoshka_dims):
                raise ValueError(f"matryoshka_dims {self.matryoshka_dims}: distinct positive sizes")
            if self.matryoshka_weights is not None and len(self.matryoshka_weights) != len(self.matryoshka_dims):
                raise ValueError(f"matryoshka_weights has {len(self.matryoshka_weights)} entries, matryoshka_dims "
                                 f"{len(self.matryoshka_dims)}: one weight per dimension")
        elif self.matryoshka_weights is not None:
            raise ValueError("matryoshka_weights without matryoshka_dims")
        if self.teacher is None:  # a value other than the default means the run was meant to distil
            given = [name for name in ("distill_alpha", "distill_temperature", "teacher_dtype")
                     if getattr(self, name) != type(self).model_fields[name].default]
            if given:
                raise ValueError(f"{', '.join(given)} without a teacher: set teacher to distil")
        if self.score_range[0] >= self.score_range[1]:
            raise ValueError(f"score_range {list(self.score_range)}: the low end must be below the high end")
        if tasks.get(self.task).pair_input and self.doc_stride >= self.max_length:  # contexts cut into windows
            raise ValueError(f"doc_stride ({self.doc_stride}) must be smaller than max_length ({self.max_length})")
        return self

    def default_metric(self, problem_type: str | None = None) -> tuple[str, str]:
        """(metric, mode) that picks the best model: --metric, else the task's default for the problem type (the
        one the data turned out to have, else --problem-type)."""
        metric = self.metric or ("loss" if self.scheduler == "reduce_lr_on_plateau" else None)  # as transformers
        if metric:
            lower = metric in LOWER_IS_BETTER or metric.endswith("loss")
            return metric, self.metric_mode or ("min" if lower else "max")
        name, mode = tasks.get(self.task).default_metric(problem_type or self.problem_type)
        return name, self.metric_mode or mode


# --resume continues the checkpoint's run. Fields it may change and still be that run: where it logs, saves and
# evaluates (RESUME_FREE), and how long it runs (RESUME_LENGTH: the schedule is rebuilt over the new length, as
# transformers' Trainer does; said in a warning). Every other field is refused: the checkpoint's place in the data
# (global batches into an epoch's seeded order), its optimizer state and its objective would mean something else.
RESUME_FREE = frozenset({
    "model", "eval", "eval_split", "output_dir", "overwrite", "resume", "eval_strategy", "eval_steps", "eval_before",
    "metric", "metric_mode", "early_stopping_patience", "early_stopping_threshold", "converged_window",
    "converged_tolerance", "save_strategy", "save_steps", "save_total_limit", "logging_steps", "report_to",
    "logging_dir", "run_name", "compile"})
RESUME_LENGTH = frozenset({"epochs", "max_steps"})
RESOLVED_PATHS = ("train",)  # compared as absolute paths: a resume may run from another directory


def resume_record(config: FinetuneConfig) -> dict[str, Any]:
    """What a checkpoint keeps of its run's config, to compare a resume against (resume_changes)."""
    record = config.model_dump(mode="json")
    for name in RESOLVED_PATHS:
        record[name] = str(Path(record[name]).resolve())
    return record


def resume_changes(saved: dict[str, Any], config: FinetuneConfig) -> tuple[list[str], list[str]]:
    """(refused, length): `field: checkpoint's -> now` for each field a resume changed, split as RESUME_FREE and
    RESUME_LENGTH say. A field the checkpoint's hfport did not know is not compared."""
    now = resume_record(config)
    refused, length = [], []
    for name in sorted(set(saved) & set(now) - RESUME_FREE):
        if saved[name] != now[name]:
            (length if name in RESUME_LENGTH else refused).append(f"{name}: {saved[name]!r} -> {now[name]!r}")
    return refused, length


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is no content
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read ({e})") from e
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml.YAMLError / JSONDecodeError carry the line
        yaml_file = path.suffix in (".yaml", ".yml")
        how = "" if yaml_file or path.suffix == ".json" else \
            f" (a config file is read as YAML when its name ends in .yaml or .yml, else as JSON; this one ends in " \
            f"{path.suffix or 'no suffix'})"
        raise ConfigError(f"{path}: not valid {'YAML' if yaml_file else 'JSON'}{how}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of option names to values")
    return data


def resolve_config(file_values: dict[str, Any] | None, flags: dict[str, Any], file_name: str = "config file"
                   ) -> tuple[FinetuneConfig, dict[str, str]]:
    """Defaults < file < flags. Returns the config and, for each field, where its value came from."""
    translated, renamed = [], {}  # aliases to hfport's names per origin, so a flag still overrides the file's alias
    implied: dict[str, Any] = {}  # what transformers derives from an alias: below every value given, in any origin
    for origin, values in ((file_name, dict(file_values or {})),
                           ("flags", {k: v for k, v in flags.items() if v is not None})):
        try:
            translated.append(translate(values, FinetuneConfig.model_fields, renamed=renamed, implied=implied))
        except ValueError as e:
            raise ConfigError(f"{origin}: {e}") from e
        for name in set(values) & set(translated[-1]):  # given under hfport's name here: an earlier alias lost
            renamed.pop(name, None)
    file_values, flags = translated
    merged = {**implied, **file_values, **{k: v for k, v in flags.items() if v is not None}}
    if isinstance(flags.get("lora"), dict) and isinstance(file_values.get("lora"), dict):
        merged["lora"] = {**file_values["lora"], **flags["lora"]}  # --lora-r refines the file's lora section
    given = {k for k, v in flags.items() if v is not None}

    def where(loc: tuple[Any, ...]) -> str:
        """A bad field's name, the alias it was given as, and (file and flags both given) which one gave it."""
        notes = [f"given as {renamed[loc[0]]}"] if loc and loc[0] in renamed else []
        if loc and file_values and given and loc[0] in {*file_values, *given}:
            # a section both give (lora: {...} and --lora-r) was merged: either may hold the bad key
            origins = [file_name] if loc[0] in file_values and (
                loc[0] not in given or isinstance(flags[loc[0]], dict)) else []
            notes.append("from " + " and ".join(origins + (["the flags"] if loc[0] in given else [])))
        return ".".join(map(str, loc)) + (f" ({', '.join(notes)})" if notes else "") if loc else "config"

    try:
        config = FinetuneConfig(**merged)
    except ValidationError as e:
        problems = "; ".join(f"{where(tuple(err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid fine-tune config: {problems}") from e
    sources = {name: "flag" if flags.get(name) is not None else file_name if name in file_values
               else "transformers' default" if name in implied else "default"
               for name in FinetuneConfig.model_fields}
    return config, sources
