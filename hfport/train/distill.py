"""Distillation (`hfport finetune --teacher MODEL`): the model trained (the student) learns a teacher's outputs; and
students built from a model by keeping some of its layers (`student_layers`, DistilBERT's recipe).

What each task learns (its TrainTask's hooks, hfport/train/tasks/):
  text-classification    the teacher's logits at temperature T: KL(softmax(t/T) || softmax(s/T)) * T^2 per row
                         (Hinton et al.; DistilBERT), a per-label binary KL for multi-label, the squared error for
                         regression
  token-classification   the same KL at each word's first sub-token (the positions evaluation scores)
  sentence-embedding     the teacher's embeddings of every text (MSE, sentence-transformers' MSELoss; through a
                         learned nn.Linear to the teacher's width when the widths differ, as its projection_dim: used
                         in training only, never saved in best/ or final/), or for (anchor, positive, negative) rows
                         the teacher's dot-product score margins (MarginMSELoss)
  text-ranking           the teacher's logit for every (query, text) pair (MSE, CrossEncoder's MSELoss)
The loss is alpha * that + (1 - alpha) * the task's own loss (distill_alpha) on the rows that have their own target;
a row without one (classification rows without a label, token rows without tags) learns from the teacher alone.

The teacher runs once, before training, in hfport's inference engine (the task's model class in eval mode under
inference_mode, at teacher_dtype), over the training examples as the task collates them: it sees the student's
tokens, so it must share the student's tokenizer. Its targets go to an encoded-examples store
(hfport/formats/encoded.py) in the cache dir (`$HFPORT_CACHE_DIR/teacher/`), one row per training example, under a
hash of the teacher's files, its dtype, the task and the examples: a resumed run and every process of a launch open
the same store (the first process writes it, the others wait for it), so the teacher's cost is paid once however
often the student runs, and a step costs what a plain step costs. Evaluation scores the student on labelled rows,
without the teacher.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import hub, lora, tasks
from ..config import EncoderConfig
from ..errors import ConfigError
from ..formats.encoded import Store, StoreBusy, evict, open_or_write, write_store
from ..formats.tables import where
from ..hardware import cache_path
from ..modeling import PreTrainedEncoder, on_meta, task_of
from ..registry import get_family
from ..settings import settings as library_settings
from ..tasks import get as task_record
from ..tokenizer import AutoTokenizer
from .amp import float32_outputs
from .data import (ENCODE_ROWS, DataError, EncodedData, Features, LabelSpace, eval_batches, example_lengths,
                   in_chunks, without_tokens)
from .stored import STORE_WAIT_S, tokenizer_digest
from .tasks import MODEL_INPUTS, TrainTask

log = logging.getLogger("hfport.train")

EVERY_OTHER = "every_other"
TEACHER_DIR = "teacher"  # under the cache dir, beside the encoded examples
FORMAT = 1  # of the stored targets; part of the key, so a change of what is stored computes them again
TEACHER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": "int8"}


# --- the losses: per unit (a row, a token, a pair), the caller takes the mean ---------------------------------------


def kl_divergence(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N, L) logits each -> (N,): KL(softmax(teacher / T) || softmax(student / T)) * T^2 per row. Its mean is
    F.kl_div(log_softmax(s / T), softmax(t / T), reduction="batchmean") * T^2, DistilBERT's loss; T^2 keeps the
    gradients' scale as T changes (Hinton et al.)."""
    log_q = F.log_softmax(student / temperature, dim=-1)  # (N, L)
    log_p = F.log_softmax(teacher / temperature, dim=-1)  # (N, L)
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1) * temperature ** 2  # (N,)


def binary_kl_divergence(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N, L) logits each -> (N,): multi-label's KL, each label a Bernoulli (sigmoid(t / T) against sigmoid(s / T)),
    the mean over labels (as the task's BCE takes it) * T^2."""
    s, t = student / temperature, teacher / temperature  # (N, L) each
    p = torch.sigmoid(t)  # (N, L)
    kl = p * (F.logsigmoid(t) - F.logsigmoid(s)) + (1 - p) * (F.logsigmoid(-t) - F.logsigmoid(-s))  # (N, L)
    return kl.mean(-1) * temperature ** 2  # (N,)


def squared_error(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(N, D) each -> (N,): the mean squared difference per row (regression's value, a reranker's logit, an
    embedding: sentence-transformers' MSELoss over the rows); no temperature."""
    return (student - teacher).pow(2).mean(-1)  # (N,)


# problem type -> what a sequence classifier's logits learn from the teacher's
SOFT_TARGETS = {"single_label_classification": kl_divergence, "multi_label_classification": binary_kl_divergence,
                "regression": squared_error}


def margin_mse(student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """MarginMSELoss per row: (B, 1 + k) scores of the positive then the k negatives, student's and teacher's, valid
    (B, 1 + k) (a row with fewer negatives: False past them) -> (B,): the mean over the row's negatives of
    ((s_pos - s_neg) - (t_pos - t_neg))^2."""
    error = ((student[:, :1] - student[:, 1:]) - (teacher[:, :1] - teacher[:, 1:])).pow(2)  # (B, k)
    negatives = valid[:, 1:]  # (B, k)
    return (error * negatives).sum(-1) / negatives.sum(-1).clamp(min=1)  # (B,)


# --- students: some of a model's layers ---------------------------------------------------------------------------

# config.json's layer count: transformers' name, and DistilBERT's own (DistilBertConfig's attribute_map)
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layers")
_LAYER = re.compile(r"^body\.encoder\.layers\.(\d+)\.(.+)$")  # hfport's name of a layer's tensor, every family's


def kept_layers(spec: list[int] | str, count: int, source: Any) -> list[int]:
    """The layer indices student_layers names in a COUNT-layer model (every_other: 0, 2, 4, ...)."""
    kept = list(range(0, count, 2)) if spec == EVERY_OTHER else list(spec)
    if kept and kept[-1] >= count:
        raise ConfigError(f"student_layers {kept}: {source} has {count} layers (0..{count - 1})")
    if len(kept) == count:
        raise ConfigError(f"student_layers {kept}: every one of {source}'s {count} layers; the student would be "
                          "the model itself")
    return kept


def keep_layers(model: PreTrainedEncoder, spec: list[int] | str) -> PreTrainedEncoder:
    """A model of MODEL's class with only the encoder layers SPEC names (student_layers), in their order, each
    holding the kept layer's tensors; everything else (embeddings, final norm, pooler, head) is MODEL's. Its config
    is MODEL's with the layer count (and a per-layer `layer_types`) cut to them, so it saves as a folder transformers
    loads as it is. Shared layers (ALBERT's groups) have no layer of their own to keep: refused."""
    config, family = model.config, model.family
    kept = kept_layers(spec, config.num_hidden_layers, config.source)
    raw = dict(config.raw)
    key = next((k for k in LAYER_COUNT_KEYS if k in raw), None)
    if key is None:
        raise ConfigError(f"{config.source}: config.json has no layer count ({' or '.join(LAYER_COUNT_KEYS)}) to cut")
    raw[key] = len(kept)
    if "layer_types" in config.extra:  # transformers' per-layer attribute (ModernBERT: full or sliding attention)
        raw["layer_types"] = [config.extra["layer_types"][i] for i in kept]
    student_config: EncoderConfig = family.config_from_hf(raw, config.source)
    student_config.set_labels(id2label=dict(config.id2label), problem_type=config.problem_type)
    layers = {int(m.group(1)) for name in model.state_dict() if (m := _LAYER.match(name))}
    if layers != set(range(config.num_hidden_layers)):
        raise ConfigError(f"{config.source}: model_type {config.model_type!r} does not hold one set of weights per "
                          f"layer (ALBERT shares its layers' weights); student_layers keeps layers that have weights "
                          "of their own")
    state = {}
    for name, tensor in model.state_dict().items():
        m = _LAYER.match(name)
        if m is None:
            state[name] = tensor
        elif int(m.group(1)) in kept:
            state[f"body.encoder.layers.{kept.index(int(m.group(1)))}.{m.group(2)}"] = tensor
    with on_meta():
        student = type(model)(student_config, family)
    student = student.to(model.dtype).to_empty(device=model.device)
    missing, unexpected = student.load_state_dict(state, strict=False)
    if missing or unexpected:  # a family whose layers differ by position (ModernBERT's first has no attention norm)
        raise ConfigError(f"{config.source}: layers {kept} do not make a {len(kept)}-layer {config.model_type} stack "
                          f"(tensors its layers lack: {unexpected[:4]}; need: {missing[:4]}); keep layer 0 first")
    student.load_report = model.load_report
    log.info("student: layers %s of %s's %d", kept, config.source, config.num_hidden_layers)
    return student.train(model.training)


def check_student_layers(config: Any, source: Path) -> None:
    """student_layers against the model's layer count, before anything is written (keep_layers checks the rest)."""
    if config.student_layers is not None:
        if lora.is_adapter_folder(source):  # its LoRA layers sit on every layer of the base
            raise ConfigError(f"student_layers: {source} is a LoRA adapter; a student keeps layers of a whole model: "
                              "merge it first (hfport export RUN --merge --out FOLDER) and pass that folder as --model")
        raw, name = hub.read_config(source)
        count = get_family(raw.get("model_type"), name).config_from_hf(raw, name).num_hidden_layers
        kept_layers(config.student_layers, count, source)


# --- the teacher: its checks and its labels ---------------------------------------------------------------------


def teacher_config(config: Any) -> tuple[Path, EncoderConfig, str]:
    """(the teacher's folder, its config, the task its checkpoint is for)."""
    folder = hub.resolve(config.teacher)
    raw, source = hub.read_config(folder)
    family = get_family(raw.get("model_type"), source)
    return folder, family.config_from_hf(raw, source), task_of(family, raw.get("architectures") or [])


def teacher_label_space(config: Any) -> LabelSpace | None:
    """With a teacher, the labels are the teacher's (its id2label, in its order: the student's logits line up with
    its logits) and labelled rows are encoded into them; the problem type is --problem-type, else the teacher's,
    else transformers' rule (one label: regression). None without a teacher."""
    if not getattr(config, "teacher", None):
        return None
    _, teacher, _ = teacher_config(config)
    problem = config.problem_type or teacher.problem_type or (
        "regression" if teacher.num_labels == 1 else "single_label_classification")
    return LabelSpace(problem, dict(teacher.id2label))


def distilled(task: TrainTask, config: Any, tokenizer: Any) -> TrainTask:
    """TASK, or with a teacher its Distillation, the teacher checked first: the task distils, the teacher's checkpoint
    is for the task's model, and it tokenizes as the student does."""
    if not config.teacher:
        return task
    if not task.distillable:
        names = [r.name for r in tasks.TASKS.values() if r.train is not None and r.train_task.distillable]
        raise ConfigError(f"teacher: {task.name} does not distil; distillation trains {', '.join(names)}")
    folder, teacher, kind = teacher_config(config)
    wanted = task_record(config.task).checkpoint_task
    if kind != wanted:
        raise ConfigError(f"teacher {folder}: a {kind} checkpoint (architectures {teacher.raw.get('architectures')}); "
                          f"a {task.name} student learns from a {wanted} checkpoint")
    if tokenizer_digest(AutoTokenizer.from_pretrained(folder)) != tokenizer_digest(tokenizer):
        raise ConfigError(f"teacher {folder}: its tokenizer differs from the student's ({config.model}); the teacher "
                          "is run on the student's tokens, so both need one vocabulary (a student built from the "
                          "teacher, student_layers, has it)")
    return Distillation(task, config, folder, teacher)


# --- the teacher's targets: computed once, stored, read back with each example -------------------------------------


def teacher_rows(base: TrainTask, folder: Path, config: Any, data: EncodedData,
                 device: torch.device) -> Iterator[list[dict[str, Any]]]:
    """The teacher's targets for every training example in order (the store's rows), ENCODE_ROWS examples at a time;
    within those, batches of similar length (little padding) of batch_size examples and max_batch_tokens."""
    model = task_record(config.task).model_class.from_pretrained(folder, dtype=TEACHER_DTYPES[config.teacher_dtype],
                                                                 device=device)
    model.eval()
    view = base.teacher_data(data, folder)
    examples = data.train
    lengths = example_lengths(examples)
    log.info("teacher %s: its outputs for %d training examples (once: they are stored for every later run)", folder,
             len(examples))
    with torch.inference_mode():
        for chunk in in_chunks(range(len(examples)), ENCODE_ROWS):
            targets: dict[int, np.ndarray] = {}
            for idx in eval_batches(chunk, lengths, config.batch_size, config.max_batch_tokens, True):
                items = [examples[i] for i in idx]
                batch = {k: v.to(device) for k, v in base.collate(items, view, seed=config.seed).items()}
                outputs = float32_outputs(base.forward(model, batch, view))
                for i, target in zip(idx, base.teacher_targets(outputs, batch, items, view)):
                    targets[i] = np.asarray(target, dtype=np.float32).reshape(-1)
            yield [{"teacher": targets[i]} for i in chunk]


def teacher_key(base: TrainTask, folder: Path, config: Any, examples: Sequence[Features]) -> str:
    """A hash of everything the targets depend on: the teacher's files, its dtype, the task, the examples."""
    files = [[str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns]
             for f in sorted(folder.rglob("*")) if f.is_file()]  # with a sentence-transformers layout's modules
    text = json.dumps({"format": FORMAT, "teacher": str(folder.resolve()), "files": files,
                       "dtype": config.teacher_dtype, "task": base.name, "examples": examples_digest(examples)},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def examples_digest(examples: Sequence[Features]) -> str:
    """A hash of what the teacher reads of the examples: a store view's by its store's key (a hash of what it was
    encoded from) and its rows; a list's by every example's tokens and meta."""
    h = hashlib.blake2b(digest_size=16)
    store = getattr(examples, "store", None)
    if store is not None:
        h.update(store.key.encode())
        index = getattr(examples, "index", None)
        h.update(b"all" if index is None else np.asarray(index, dtype=np.int64).tobytes())
        return h.hexdigest()
    for x in examples:
        h.update(np.asarray(x.input_ids, dtype=np.int64).tobytes())
        h.update(b"|" if x.token_type_ids is None else np.asarray(x.token_type_ids, dtype=np.int64).tobytes())
        h.update(json.dumps(x.meta, sort_keys=True, default=lambda v: v.tolist()).encode())
    return h.hexdigest()


def teacher_store(base: TrainTask, folder: Path, config: Any, data: EncodedData, device: torch.device) -> Store:
    """The stored targets for DATA's training examples: opened when an earlier run (or another process of this one)
    wrote them, else computed here (teacher_rows) and written."""
    key = teacher_key(base, folder, config, data.train)
    target = cache_path().parent / TEACHER_DIR / key[:32]

    def write() -> Store:
        return write_store(target, {"teacher": "float32"}, teacher_rows(base, folder, config, data, device), key,
                           lambda: {"teacher": str(folder), "examples": len(data.train)})

    try:
        store, wrote = open_or_write(target, key, write, STORE_WAIT_S)
    except StoreBusy as e:
        raise StoreBusy(f"teacher {folder}: {e}") from e
    if wrote:
        evict(target.parent, library_settings().store_max_bytes, keep=target)
    else:
        log.info("teacher %s: its outputs read from %s", folder, target)
    return store


class TeacherExamples(Sequence[Features]):
    """The training examples, each with its teacher targets in meta["teacher"] (a flat float32 array, read from the
    store when the example is asked for)."""

    def __init__(self, examples: Sequence[Features], store: Store):
        if len(store) != len(examples):
            raise ValueError(f"{store.folder}: {len(store)} stored targets for {len(examples)} examples")
        self.examples, self.store = examples, store

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Features:  # type: ignore[override]
        x = self.examples[i]
        return dataclasses.replace(x, meta={**x.meta, "teacher": self.store.row(i % len(self))["teacher"]})

    @property
    def lengths(self) -> Sequence[int]:
        return example_lengths(self.examples)

    def without_tokens(self) -> Any:
        return without_tokens(self.examples)


# --- the task -------------------------------------------------------------------------------------------------------


def _rows(values: Any, keep: torch.Tensor, keys: tuple[str, ...] | None = None) -> Any:
    """A batch (its KEYS) or a model output with only the rows KEEP (B,) marks."""
    if isinstance(values, dict):
        return {k: v[keep] if k in (keys or ()) else v for k, v in values.items()}
    fields = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
    return dataclasses.replace(values, **{name: v[keep] for name, v in fields.items()
                                          if torch.is_tensor(v) and v.shape[:1] == keep.shape})


class Distillation(TrainTask):
    """A task trained with a teacher: the task reads, collates, evaluates and saves as it does alone; the training
    loss adds what the teacher's stored outputs teach (the task's distill_terms), mixed with its own loss by
    distill_alpha. Evaluation is the task's own, on labelled rows."""

    distillable = False  # a distillation does not distil again

    def __init__(self, base: TrainTask, config: Any, folder: Path, teacher: EncoderConfig):
        self.base, self.config, self.folder, self.teacher = base, config, folder, teacher
        self.name, self.compute_metrics = base.name, base.compute_metrics
        self.alpha, self.temperature = config.distill_alpha, config.distill_temperature
        self.companion: torch.nn.Module | None = None

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        data = self.base.read(config, tokenizer, model_id2label)
        if data.space is not None and len(data.space.id2label) != self.teacher.num_labels:
            raise ConfigError(f"teacher {self.folder}: {self.teacher.num_labels} labels; a {self.name} student has "
                              f"{len(data.space.id2label)} ({list(data.space.id2label.values())})")
        hint = "give --eval a file of labelled rows" + ("" if config.eval else ", or eval_fraction 0 to train without "
                                                         "evaluation (the held-out rows come from --train)")
        self.check_labelled(data, data.eval, f"an evaluation row without its own target: evaluation scores the "
                                             f"student against the data's targets; {hint}")
        if config.class_weights == "balanced":
            self.check_labelled(data, data.train, "a row without a label: class_weights 'balanced' counts the "
                                                  "labels of every row; give one weight per label instead")
        return data

    def check_labelled(self, data: EncodedData, examples: Sequence[Features], problem: str) -> None:
        if type(self.base).labelled is TrainTask.labelled:  # the task's rows always have their own targets
            return
        for chunk in in_chunks(range(len(examples)), ENCODE_ROWS):
            items = [examples[i] for i in chunk]
            labelled = self.base.labelled(self.base.collate(items, data, seed=0), data)  # (B,) | None
            if labelled is not None and not bool(labelled.all()):
                x = items[int((~labelled).nonzero()[0, 0])]
                raise DataError(f"{where(x.source[0], x.source[1])}: {problem}")

    def before_training(self, data: EncodedData, device: torch.device) -> None:
        """The teacher's targets (computed now, or read from an earlier run's store) joined to the training
        examples, and the module the loss trains beside the model, if the task has one."""
        data.train = TeacherExamples(data.train, teacher_store(self.base, self.folder, self.config, data, device))
        self.companion = self.base.distill_companion(data, self.teacher.hidden_size, self.config.seed)

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        """The task's batch; training batches add `teacher`, every example's targets one after another."""
        batch = self.base.collate(items, data, seed)
        if "teacher" in items[0].meta:
            batch["teacher"] = torch.from_numpy(np.concatenate([x.meta["teacher"] for x in items]))  # (sum sizes,)
        return batch

    def forward(self, model: Any, batch: dict[str, torch.Tensor], data: EncodedData) -> Any:
        return self.base.forward(model, batch, data)

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        """alpha * the mean distillation loss + (1 - alpha) * the task's own loss; with rows that have no target of
        their own, their units count with weight 1 in the distillation mean and the task's loss is over the other
        rows, weighted by their share of the units. Without teacher targets (evaluation): the task's own loss."""
        if "teacher" not in batch:
            return self.base.loss(outputs, batch, data, class_weights, label_smoothing)
        kd, unit_rows = self.base.distill_terms(outputs, batch, batch["teacher"], data, self.temperature,
                                                self.companion)  # (n,), (n,)
        labelled = self.base.labelled(batch, data)  # (B,) | None
        if labelled is None or bool(labelled.all()):
            return self.alpha * kd.mean() + (1 - self.alpha) * self.base.loss(outputs, batch, data, class_weights,
                                                                              label_smoothing)
        own_rows = labelled[unit_rows]  # (n,): units of rows with a target of their own
        teacher_term = (self.alpha * kd[own_rows].sum() + kd[~own_rows].sum()) / kd.numel()
        if not bool(labelled.any()):
            return teacher_term
        own = self.base.loss(_rows(outputs, labelled), _rows(batch, labelled, (*MODEL_INPUTS, "labels")), data,
                             class_weights, label_smoothing)
        return teacher_term + (1 - self.alpha) * own * (own_rows.sum() / kd.numel())

    def loss_options(self, data: EncodedData) -> frozenset[str]:
        return self.base.loss_options(data)  # the task's own loss, mixed with the teacher's terms

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        if "teacher" not in batch:
            return self.base.loss_count(batch, data, class_weights)
        return self.base.distill_units(batch, data)

    def unused_modules(self, model: Any) -> list[str]:
        return self.base.unused_modules(model)

    def write_model_files(self, folder: Path, data: EncodedData) -> None:
        self.base.write_model_files(folder, data)

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        return self.base.eval_rows(outputs, batch, items, data)

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        return self.base.metrics(rows, data, id2label)

    def metric_names(self, data: EncodedData) -> list[str]:
        return self.base.metric_names(data)
