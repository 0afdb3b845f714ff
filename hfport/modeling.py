"""The task models (base + four heads), loading from HF checkpoints and saving in the HF layout.

Every task model is `body` (the family's encoder) + `head` (from heads.py). Names inside hfport are the same for
every family; the family's key map translates them to and from the checkpoint's names.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from . import hub
from .config import TASKS, EncoderConfig
from .errors import CheckpointError, ConfigError
from .heads import (MaskedLMHead, infer_problem_type, masked_lm_loss, question_answering_loss,
                    sequence_classification_loss, token_classification_loss)
from .outputs import (BaseModelOutput, MaskedLMOutput, QuestionAnsweringOutput, SequenceClassifierOutput,
                      TokenClassifierOutput)
from .registry import Family, get_family

log = logging.getLogger("hfport")

# Weights a checkpoint may lack that transformers creates fresh (with a warning) rather than refuse.
FRESH_OK_PREFIXES = ("head.", "body.pooler.")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadReport:
    """What from_pretrained did with each weight."""

    source: str
    loaded: list[str] = field(default_factory=list)  # hfport names filled from the checkpoint
    initialized: list[str] = field(default_factory=list)  # absent from the checkpoint: freshly initialised
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys this task does not use
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # re-initialised
    nonfinite: list[str] = field(default_factory=list)  # checkpoint keys holding NaN or inf (export refuses them)

    @property
    def missing(self) -> list[str]:
        return self.initialized

    def summary(self) -> str:
        lines = [f"loaded {len(self.loaded)} tensors from {self.source}"]
        if self.initialized:
            lines.append(f"initialized fresh ({len(self.initialized)}): {', '.join(self.initialized)}")
        if self.unexpected:
            lines.append(f"unused checkpoint keys ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        for key, theirs, ours in self.mismatched:
            lines.append(f"shape mismatch re-initialised: {key} checkpoint {list(theirs)} model {list(ours)}")
        if self.nonfinite:
            lines.append(f"NaN/inf values ({len(self.nonfinite)}): {', '.join(self.nonfinite)}")
        return "\n".join(lines)


def resolve_dtype(dtype: Any, config: EncoderConfig | None = None, device: Any = None) -> torch.dtype:
    """None: float32. "auto": the checkpoint's dtype (config.json's `dtype`, or transformers 4's `torch_dtype`),
    except that an fp32 checkpoint bound for a CPU that computes bf16 natively (measured: hardware.py) gets bf16."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        from .hardware import auto_dtype

        raw = config.raw if config else {}
        return auto_dtype(resolve_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32"), device)
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


@torch.no_grad()
def init_module(module: nn.Module, std: float) -> None:
    """transformers' _init_weights for these families."""
    if isinstance(module, nn.Linear):
        module.weight.normal_(0.0, std)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, nn.Embedding):
        module.weight.normal_(0.0, std)
        if module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            module.weight.fill_(1.0)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, MaskedLMHead):
        module.bias.zero_()


class PreTrainedEncoder(nn.Module):
    """Shared by the five task classes: construction from a config, from_pretrained and save_pretrained."""

    task: ClassVar[str] = "base"

    def __init__(self, config: EncoderConfig, family: Family | None = None):
        super().__init__()
        self.family = family or get_family(config.model_type, config.source)
        self.config = config
        self.body = self.family.build_body(config, self.task)
        self.head = self.family.build_head(config, self.task)
        self.load_report: LoadReport | None = None

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: EncoderConfig | dict[str, Any], **labels: Any) -> PreTrainedEncoder:
        """A randomly initialised model (as transformers initialises it) from an EncoderConfig or a config dict."""
        if isinstance(config, dict):
            config = get_family(config.get("model_type")).config_from_hf(config, "config")
        config.set_labels(**labels)
        model = cls(config)
        model.apply(lambda m: init_module(m, config.initializer_range))
        if model.family.after_init:
            model.family.after_init(model, config)
        return model

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike[str], *, num_labels: int | None = None,
                        id2label: dict[int, str] | None = None, label2id: dict[str, int] | None = None,
                        problem_type: str | None = None, dtype: Any = None, device: Any = None,
                        ignore_mismatched_sizes: bool = False, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None) -> PreTrainedEncoder:
        folder = hub.resolve(path_or_repo_id, revision=revision, cache_dir=cache_dir)
        raw, source = hub.read_config(folder)
        family = get_family(raw.get("model_type"), source)
        config = family.config_from_hf(raw, source)
        config.set_labels(num_labels=num_labels, id2label=id2label, label2id=label2id, problem_type=problem_type)
        torch_dtype = resolve_dtype(dtype, config, device)
        config.check_size(torch.finfo(torch_dtype).bits // 8)
        checkpoint = hub.Checkpoint.open(folder)  # headers validated before anything is allocated

        with torch.device("meta"):
            model = cls(config, family)
        model = model.to(torch_dtype).to_empty(device=device or "cpu")
        model.load_report = model._load(checkpoint, ignore_mismatched_sizes)
        return model.eval()

    def _plan(self, checkpoint: hub.Checkpoint) -> tuple[dict[str, str], list[str]]:
        """checkpoint key -> hfport name for the keys this model uses; the rest are returned as unused."""
        family, prefix = self.family, self.family.prefix + "."
        head_map = family.head_map(self.config, self.task)
        others = [m for t, m in family.head_keys.items() if t != self.task] + [family.ignored_keys]
        plan: dict[str, str] = {}
        unused, unknown = [], []
        for key in checkpoint.keys():
            local = legacy_name(key.removeprefix(prefix))
            matched, name = family.body_keys.to_hfport(local)
            if matched:
                if name is not None:
                    plan[key] = "body." + name
                continue
            if head_map is not None:
                matched, name = head_map.to_hfport(local)
                if matched:
                    if name is not None:
                        plan[key] = "head." + name
                    continue
            if any(m.to_hfport(local)[0] for m in others):
                unused.append(key)
            else:
                unknown.append(key)
        if unknown:
            raise CheckpointError(
                f"{checkpoint.folder}: {len(unknown)} key(s) not in the {family.model_type} key map: "
                f"{', '.join(unknown[:10])}")
        return plan, unused

    @torch.no_grad()
    def _load(self, checkpoint: hub.Checkpoint, ignore_mismatched_sizes: bool) -> LoadReport:
        report = LoadReport(str(checkpoint.folder))
        plan, report.unexpected = self._plan(checkpoint)
        params = dict(self.named_parameters())
        tied = self.tied_names()
        chosen: dict[str, str] = {}  # hfport name -> checkpoint key (first alias wins)
        for key, name in plan.items():
            if name not in params:
                if name not in tied:
                    report.unexpected.append(key)
                continue
            chosen.setdefault(name, key)
        bad = []
        for name, key in list(chosen.items()):
            theirs, ours = checkpoint.shape(key), tuple(params[name].shape)
            if theirs != ours:
                if ignore_mismatched_sizes and name.startswith(FRESH_OK_PREFIXES):
                    report.mismatched.append((key, theirs, ours))
                    del chosen[name]
                else:
                    bad.append(f"{key}: checkpoint {list(theirs)} vs model {list(ours)} ({name})")
        if bad:
            hint = (" (a different num_labels? pass ignore_mismatched_sizes=True to start that head fresh)"
                    if any("head." in b for b in bad) else "")
            raise CheckpointError(f"{checkpoint.folder}: shape mismatch{hint}: " + "; ".join(bad))
        missing = [n for n in params if n not in chosen]
        required = [n for n in missing if not n.startswith(FRESH_OK_PREFIXES)]
        if required:  # named as the checkpoint would name them, with hfport's name alongside
            prefix = self.family.prefix + "."
            prefixed = any(k.startswith(prefix) for k in checkpoint.keys())
            hf = {n: (prefix if prefixed else "") + k.removeprefix(prefix) for n, k in self.hf_names().items()}
            raise CheckpointError(f"{checkpoint.folder}: the checkpoint lacks body weights ({len(required)}): "
                                  + ", ".join(f"{hf[n]} ({n})" for n in required[:10]))
        by_key = {key: name for name, key in chosen.items()}
        for key, tensor in checkpoint.tensors(list(by_key)):
            params[by_key[key]].copy_(tensor)
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                report.nonfinite.append(key)
        if report.nonfinite:
            log.warning("%s: NaN or inf values in %d tensor(s): %s", checkpoint.folder, len(report.nonfinite),
                        ", ".join(report.nonfinite))
        report.loaded = sorted(chosen)
        report.initialized = missing
        if missing:
            owners = {n.rsplit(".", 1)[0] for n in missing}
            for mod_name, module in self.named_modules():
                if mod_name in owners:
                    init_module(module, self.config.initializer_range)
            log.warning("%s: initialised fresh, train before use: %s", checkpoint.folder, ", ".join(missing))
        return report

    def tied_names(self) -> set[str]:
        """hfport names the checkpoint may carry that this model shares with another weight instead."""
        head = self.head
        if isinstance(head, MaskedLMHead) and head.decoder is None:
            return {"head.decoder.weight", "head.decoder.bias"}  # older files repeat the bias under this name
        return set()

    # --- saving -------------------------------------------------------------------------------------------

    def hf_names(self) -> dict[str, str]:
        """hfport name -> the name transformers gives the same tensor for this family and task."""
        family = self.family
        body_prefix = "" if self.task == "base" else family.prefix + "."
        head_map = family.head_map(self.config, self.task)
        out: dict[str, str] = {}
        for name in self.state_dict():
            part, local = name.split(".", 1)
            hf = family.body_keys.to_hf(local) if part == "body" else head_map.to_hf(local) if head_map else None
            if hf is None:
                raise KeyError(f"{family.model_type} key map has no HF name for {name!r}")
            out[name] = (body_prefix if part == "body" else "") + hf
        return out

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Parameters under the names transformers uses for this family and task."""
        names = self.hf_names()
        return {names[name]: tensor for name, tensor in self.state_dict().items()}

    def save_pretrained(self, save_directory: str | os.PathLike[str], max_shard_size: int | str = "5GB") -> Path:
        """config.json + model.safetensors (or shards + index) in the layout transformers writes."""
        target = Path(save_directory)
        staging = hub.staging_dir(target)
        try:
            hub.save_weights(self.hf_state_dict(), staging, max_shard_size)
            config = self.config.to_hf_dict(self.family.architectures[self.task])
            config["dtype"] = str(self.dtype).removeprefix("torch.")
            config.pop("torch_dtype", None)
            hub.write_json_atomic(staging / "config.json", config)
            hub.publish(staging, target)
        except BaseException:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    # --- facts --------------------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @property
    def padding_free(self) -> bool:
        """True (the default): batches with padding run on their real tokens only (nn/unpad.py); padding
        positions of token-level outputs are then zeros (hidden states) or what the head makes of zeros."""
        return self.body.padding_free

    @padding_free.setter
    def padding_free(self, value: bool) -> None:
        self.body.padding_free = bool(value)

    def _body(self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None,
              position_ids: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return self.body(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids)


def legacy_name(key: str) -> str:
    """Old TF-converted checkpoints call LayerNorm's weight and bias gamma and beta."""
    if key.endswith(".gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith(".beta"):
        return key[: -len("beta")] + "bias"
    return key


class EncoderModel(PreTrainedEncoder):
    task = "base"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None) -> BaseModelOutput:
        hidden, pooled = self._body(input_ids, attention_mask, token_type_ids, position_ids)
        return BaseModelOutput(last_hidden_state=hidden, pooler_output=pooled)


class EncoderForSequenceClassification(PreTrainedEncoder):
    task = "sequence-classification"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None) -> SequenceClassifierOutput:
        hidden, pooled = self._body(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.head(pooled if pooled is not None else hidden[:, 0])  # (B, L)
        loss = None
        if labels is not None:
            if self.config.problem_type is None:  # transformers records the inferred type in the config
                self.config.problem_type = infer_problem_type(self.config.num_labels, labels)
            loss = sequence_classification_loss(logits, labels, self.config.problem_type)
        return SequenceClassifierOutput(logits=logits, loss=loss)


class EncoderForTokenClassification(PreTrainedEncoder):
    task = "token-classification"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None) -> TokenClassifierOutput:
        hidden, _ = self._body(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.head(hidden)  # (B, T, L)
        loss = token_classification_loss(logits, labels) if labels is not None else None
        return TokenClassifierOutput(logits=logits, loss=loss)


class EncoderForQuestionAnswering(PreTrainedEncoder):
    task = "question-answering"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, start_positions: Tensor | None = None,
                end_positions: Tensor | None = None) -> QuestionAnsweringOutput:
        hidden, _ = self._body(input_ids, attention_mask, token_type_ids, position_ids)
        start, end = self.head(hidden)  # (B, T) each
        if attention_mask is not None:  # an answer never starts or ends on padding (transformers scores it)
            padding = ~attention_mask.bool()
            start = start.masked_fill(padding, torch.finfo(start.dtype).min)
            end = end.masked_fill(padding, torch.finfo(end.dtype).min)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = question_answering_loss(start, end, start_positions, end_positions)
        return QuestionAnsweringOutput(start_logits=start, end_logits=end, loss=loss)


class EncoderForMaskedLM(PreTrainedEncoder):
    task = "masked-lm"

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None) -> MaskedLMOutput:
        hidden, _ = self._body(input_ids, attention_mask, token_type_ids, position_ids)
        logits = self.head(hidden, self.body.word_embeddings.weight)  # (B, T, V)
        loss = masked_lm_loss(logits, labels) if labels is not None else None
        return MaskedLMOutput(logits=logits, loss=loss)


TASK_CLASSES: dict[str, type[PreTrainedEncoder]] = {
    c.task: c for c in (EncoderModel, EncoderForSequenceClassification, EncoderForTokenClassification,
                        EncoderForQuestionAnswering, EncoderForMaskedLM)}
assert set(TASK_CLASSES) == set(TASKS)

# transformers' names for the same classes
AutoModel = EncoderModel
AutoModelForSequenceClassification = EncoderForSequenceClassification
AutoModelForTokenClassification = EncoderForTokenClassification
AutoModelForQuestionAnswering = EncoderForQuestionAnswering
AutoModelForMaskedLM = EncoderForMaskedLM


def load_any(path_or_repo_id: str | os.PathLike[str], **kwargs: Any) -> PreTrainedEncoder:
    """Load with the head the checkpoint's config.json names in `architectures` (base if none)."""
    folder = hub.resolve(path_or_repo_id, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"))
    raw, source = hub.read_config(folder)
    family = get_family(raw.get("model_type"), source)
    task = task_of(family, raw.get("architectures") or [])
    return TASK_CLASSES[task].from_pretrained(folder, **kwargs)


def task_of(family: Family, architectures: list[str]) -> str:
    by_class = {cls_name: task for task, cls_name in family.architectures.items()}
    for arch in architectures:
        if arch in by_class:
            return by_class[arch]
    for arch in architectures:  # e.g. BertForPreTraining: the body is what hfport can use
        if not isinstance(arch, str):
            raise ConfigError(f"architectures entry {arch!r} is not a string")
    return "base"
