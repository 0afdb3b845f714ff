"""Request and response bodies of every route: what OpenAPI shows."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from hfport import FinetuneConfig, tasks
from hfport.export import DEFAULT_FORMAT, FORMATS, ExportError

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
# transformers' pipeline tags (the tasks a pipeline serves: not the model-only pretraining heads); an alias
# (sentiment-analysis, ner, hfport's old sequence-classification...) is accepted and stored as the canonical name; an
# unknown name is an error listing them all
PipelineTask = Annotated[Literal[tuple(tasks.PIPELINE_TASKS)], BeforeValidator(  # type: ignore[valid-type]
    lambda v: tasks.canonical(v) if isinstance(v, str) else v)]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class ErrorBody(BaseModel):
    error: str = Field(description="what went wrong, for a person")
    error_type: str = Field(description="a stable kind, for a program (e.g. NotFound, PathNotAllowed)")


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 403, 404, 409, 413, 422, 429, 503, 504)}


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    version: str
    jobs: dict[str, int] = Field(description="job counts by status")
    models_loaded: int
    device: str = Field(description="where served models run (HFPORT_DEVICE resolved), e.g. cpu or "
                        "'cuda:0 (NVIDIA H200)'")
    dtype: str = Field(description="the dtype models are loaded in, as set (HFPORT_PREDICT_DTYPE; auto: the "
                       "checkpoint's, bf16 for an fp32 checkpoint on a CUDA GPU or a CPU with native bf16). What a "
                       "loaded model computes in, int8 included, is TEI's /info model_dtype")
    resources: dict[str, float] = Field(default_factory=dict, description="the server process and machine: "
                                        "cpu_percent, rss_gb, mem_used_gb/mem_total_gb, gpu<i>_* when CUDA is used")
    trainable_tasks: list[str] = Field(default_factory=list, description="tasks a fine-tune job accepts")
    features: dict[str, bool] = Field(default_factory=dict, description="optional abilities, e.g. lora (the "
                                      "fine-tune config accepts LoRA options)")


class ModelRegistration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME_PATTERN, description="the name /predict and jobs refer to")
    path: str = Field(description="an HF model folder inside the allowed dirs (relative: from the data dir)")
    task: PipelineTask | None = Field(None, description="default task; else taken from the model's head. "
                                       f"{tasks.names_help()}")
    kind: Literal["model", "adapter"] | None = Field(None, description="'adapter' for a LoRA adapter folder (PEFT's "
                                                     "format); default: read off the folder")
    base: str | None = Field(None, description="an adapter's base model: a registered model name or a folder; "
                                               "default the adapter's base_model_name_or_path. Adapters over one "
                                               "base share its weights in memory")


class ModelInfo(BaseModel):
    name: str
    path: str
    task: str | None
    kind: str = Field("model", description="'model' or 'adapter' (a LoRA adapter over `base`)")
    base: str | None = Field(None, description="an adapter's base model folder")
    source: str = Field(description="'registered', or 'job:<id>' for a fine-tune's best model")
    created_at: float


class ModelList(BaseModel):
    models: list[ModelInfo]


class Deleted(BaseModel):
    deleted: str


PredictInput = str | dict[str, Any]


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="a registered model name")
    inputs: PredictInput | list[PredictInput] = Field(
        description="a text, an object ({'text','text_pair'} or {'question','context'}), or a list of them")
    parameters: dict[str, Any] = Field(default_factory=dict,
                                       description="pipeline options, named as in transformers (top_k, "
                                                   "aggregation_strategy, ...)")
    task: PipelineTask | None = Field(None, description=f"overrides the model's task. {tasks.names_help()}")


class PredictResponse(BaseModel):
    model: str
    task: str
    outputs: Any = Field(description="one result per input, in order (a list input may hold "
                                     "{'error','error_type','index'} entries); a single input gets its result")


class FinetuneJobConfig(FinetuneConfig):
    """hfport.FinetuneConfig (as `hfport finetune --config`), with paths inside the allowed dirs.

    A subclass, so every field comes with its type, default, description and validators (a new field appears here
    untouched) and unknown fields are refused; restated is only what the service means differently: paths inside
    the allowed dirs, the job's own run folder, and the two options the server sets itself."""

    model: str = Field(description="a registered model name, or a model folder inside the allowed dirs")
    teacher: str | None = Field(None, description="distillation's teacher, as model: a registered model name, or a "
                                                  "model folder inside the allowed dirs")
    train: str = Field(description="training data inside the allowed dirs (relative: from the data dir): a CSV/TSV, "
                                   "JSONL, Parquet or Arrow file, a glob of Parquet/Arrow files, or a datasets "
                                   "save_to_disk folder (its split: train_split); the upload route takes it from the "
                                   "uploaded file")
    eval: str | None = Field(None, description="evaluation data inside the allowed dirs, as train (its split: "
                                               "eval_split); else a seeded eval_fraction of train")
    output_dir: str | None = Field(None, description="the run folder: default <data_dir>/runs/<job id>/run; else a "
                                                     "new or empty folder inside the allowed dirs")
    resume: None = Field(None, description="set by the server: a restarted job resumes on its own")
    logging_dir: None = Field(None, description="set by the server: TensorBoard (report_to) writes under the job's "
                                                "run folder, runs/<run_name>")
    overwrite: Literal[False] = Field(False, description="set by the server: a job writes a fresh folder")


class FinetuneJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    config: FinetuneJobConfig = Field(
        description=f"the fine-tune's options (task as {tasks.names_help(trainable_only=True)})")
    register_as: str | None = Field(None, pattern=NAME_PATTERN,
                                    description="model name for the best checkpoint (default finetune-<job id>)")


class ExportJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="a registered model name, a model folder or a fine-tune run folder (its best/), "
                                   "inside the allowed dirs")
    format: Literal[tuple(FORMATS)] = Field(  # type: ignore[valid-type]
        DEFAULT_FORMAT, description="the export format (hfport.export.FORMATS): "
                                    + "; ".join(f"{f.name}: {f.writes}" for f in FORMATS.values()))
    output_dir: str | None = Field(None, description="default <data_dir>/runs/<job id>/export")
    options: dict[str, Any] = Field(default_factory=dict, description="the format's options: " + "; ".join(
        f"{f.name}: {', '.join(f.option_names())}" for f in FORMATS.values()))
    verify: bool = Field(True, description="check the export against its source before it appears (the ONNX "
                                           "formats always do)")
    gate_data: str | None = Field(None, description="onnx-int8: a file inside the allowed dirs (relative: from the "
                                                    "data dir) of texts the int8 gate judges: one a line, or JSONL "
                                                    "with text / text_pair; at least 64")

    @model_validator(mode="after")
    def _options(self) -> ExportJobRequest:
        if "gate_data" in self.options:  # a path: only the top-level field, which the server confines
            raise ValueError("options.gate_data: give the file as the body's gate_data field")
        if self.gate_data is not None and "gate_data" not in FORMATS[self.format].option_names():
            takers = [f.name for f in FORMATS.values() if "gate_data" in f.option_names()]
            raise ValueError(f"gate_data: only with format {' or '.join(takers)}")
        try:  # the format's own options model: an unknown or bad option is a 422 naming it
            self.options = FORMATS[self.format].options.of(**self.options).model_dump(exclude_unset=True)
        except ExportError as e:
            raise ValueError(f"options for format {self.format}: {e}") from e
        return self


class EvaluateJobRequest(BaseModel):
    """hfport.evaluate's arguments (as `hfport evaluate`), with paths inside the allowed dirs."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="a registered model name, a model folder or a fine-tune run folder (its best/), "
                                   "inside the allowed dirs")
    task: PipelineTask = Field(description=f"the task: {tasks.names_help(trainable_only=True)}")
    data: str = Field(description="labelled data inside the allowed dirs (relative: from the data dir), in the "
                                  "format fine-tuning reads for the task (sentence-embedding: (query, positive) rows)")
    corpus: str | None = Field(None, description="sentence-embedding: distractors for the corpus, a file inside the "
                                                 "allowed dirs (.txt, one text a line, or a data file with `text`)")
    compare: str | None = Field(None, description="another model evaluated the same way, side by side (a registered "
                                                  "name or a folder, as model)")
    options: dict[str, Any] = Field(default_factory=dict, description="how to read the data, by fine-tuning's option "
                                    "names (text_column, label_column, anchor_column, max_length, ...); "
                                    "sentence-embedding also takes query_prompt, corpus_prompt_name, use_faiss, ...")
    dtype: str | None = Field(None, description="as `hfport predict --dtype`: float32, bfloat16, int8, ...")
    batch_size: int | None = Field(None, ge=1, description="examples per forward pass")
    output_dir: str | None = Field(None, description="where eval.json and report.html go: default "
                                                     "<data_dir>/runs/<job id>/evaluate")


class JobInfo(BaseModel):
    id: str
    kind: Literal["finetune", "export", "evaluate"]
    status: JobStatus
    config: dict[str, Any]
    progress: dict[str, Any] = Field(description="step, epoch, total_steps when known; num_processes (a fine-tune's "
                                      "ranks, HFPORT_JOB_PROCESSES); eta_s, steps_per_s, tokens_per_s and "
                                      "resources (rss_gb, gpu0_mem_used_gb...) while it trains")
    metrics: dict[str, Any] = Field(description="the latest train and eval values")
    result: dict[str, Any] | None
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    heartbeat_at: float | None
    pid: int | None
    attempts: int = Field(description="runs started; more than 1 after a restart resumed it")
    cancel_requested: bool


class JobList(BaseModel):
    jobs: list[JobInfo]
