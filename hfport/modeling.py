"""PreTrainedEncoder, what every task model shares: construction, loading from HF checkpoints and saving in the
HF layout. The task models themselves live with their task records in hfport/tasks/.

Every task model is `body` (the family's encoder) + `head` (the task's head factory, with the family's options).
Names inside hfport are the same for every family; the family's key map translates them to and from the
checkpoint's names.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import Tensor, nn

from . import hub
from .config import EncoderConfig
from .errors import CheckpointError, ConfigError
from .formats.adapter import is_adapter_folder, read_adapter_config
from .hardware import auto_dtype, resolve_device
from .heads import MaskedLMHead
from .keymap import KeyMap
from .nn.int8 import Int8Linear
from .nn.layers import EncoderLayer
from .nn.lora import Route
from .registry import Family, get_family
from .staging import staged

log = logging.getLogger("hfport")

# Weights a checkpoint may lack that transformers creates fresh (with a warning) rather than refuse.
FRESH_OK_PREFIXES = ("head.", "body.pooler.")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}
# int8 is a way of loading, not a tensor dtype: the encoder's Linear layers quantized (nn/int8.py) after an fp32
# load, held to the int8 gate; "auto-int8" falls back to bf16 where the gate refuses (hfport/int8.py)
INT8_DTYPES = ("int8", "auto-int8")


@dataclass
class LoadReport:
    """What from_pretrained did with each weight."""

    source: str
    loaded: list[str] = field(default_factory=list)  # hfport names filled from the checkpoint
    initialized: list[str] = field(default_factory=list)  # absent from the checkpoint: freshly initialised
    unexpected: list[str] = field(default_factory=list)  # checkpoint keys this task does not use
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # re-initialised
    nonfinite: list[str] = field(default_factory=list)  # checkpoint keys holding NaN or inf (export refuses them)
    notes: list[str] = field(default_factory=list)  # how the model was chosen, when not as config.json asked

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
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def resolve_dtype(dtype: Any, config: EncoderConfig | None = None, device: Any = None) -> torch.dtype:
    """None: float32. "auto": the checkpoint's dtype (config.json's `dtype`, or transformers 4's `torch_dtype`),
    except that an fp32 checkpoint bound for a CPU that computes bf16 natively (measured: hardware.py) gets bf16."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype in INT8_DTYPES:
        raise ValueError(f"dtype {dtype!r} quantizes a model as it loads: pass it to from_pretrained or to "
                         "pipeline(model=<folder>), not to a model already loaded")
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        raw = config.raw if config else {}
        return auto_dtype(resolve_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32"), device)
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}, 'auto', 'int8' or 'auto-int8'")
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
    elif isinstance(module, MaskedLMHead) and module.bias is not None:  # ModernBERT may have no logits bias
        module.bias.zero_()


BASE_TASK = "feature-extraction"  # the bare encoder's task: what a checkpoint without a known head loads as


# How an adapter folder (formats/adapter.py) becomes a `cls` model over its base: hfport.lora.load_adapter. It sits a
# floor above this module (which task a PEFT task_type is comes from the task records, and the base loads as the bare
# encoder's class), so it is handed down instead of imported: hfport.lora installs it when imported, and hfport's
# __init__ imports hfport.lora, so every from_pretrained has it.
ADAPTER_LOADER: Callable[..., PreTrainedEncoder] | None = None
# How an fp32 model becomes int8 behind its gate (dtype "int8" / "auto-int8"): hfport.int8.quantize_loaded, handed
# down the same way (the gate reads the task records and the judged texts, floors above), installed on import.
INT8_LOADER: Callable[..., PreTrainedEncoder] | None = None


class _SkipInit(torch.overrides.TorchFunctionMode):
    """While a model is built on the meta device to be loaded: the modules' own initialisers (normal_, uniform_,
    fill_, zero_ on their fresh parameters) return the tensor untouched. On meta they compute nothing anyway, but
    torch implements normal_ there in Python and the first call imports torch._dynamo: ~1 s of every process's
    first from_pretrained (MiniLM: 0.97 -> 0.1 s), i.e. of every CLI call and server start. A mode is per thread:
    a model built meanwhile in another thread initialises as usual."""

    SKIP = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_,
                      *(getattr(nn.init, name) for name in ("normal_", "uniform_", "trunc_normal_", "constant_",
                                                            "ones_", "zeros_", "kaiming_uniform_", "kaiming_normal_",
                                                            "xavier_uniform_", "xavier_normal_"))})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in self.SKIP:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
            if isinstance(target, Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device, their initialisers skipped (_SkipInit says why): for models whose tensors
    come next from a checkpoint or another model."""
    with torch.device("meta"), _SkipInit():
        yield


class PreTrainedEncoder(nn.Module):
    """Shared by the task classes: construction from a config, from_pretrained and save_pretrained."""

    task: ClassVar[str] = BASE_TASK  # the canonical task name (hfport/tasks/), which keys the family's tables
    # (config, **options the family gives this task) -> the head module, or None for the bare encoder
    head_factory: ClassVar[Callable[..., nn.Module | None]]

    def __init__(self, config: EncoderConfig, family: Family | None = None):
        super().__init__()
        self.family = family or get_family(config.model_type, config.source)
        self.config = config
        self.body = self.family.build_body(config, self.task)
        self.head = self.head_factory(config, **self.family.options_for(config, self.task))
        self.load_report: LoadReport | None = None
        self.adapter: Any = None  # hfport.lora.AdapterInfo when LoRA layers are applied (hfport/lora.py)
        # serving many adapters over one body (hfport.lora.AdapterSet.adopt): the set whose body this model shares,
        # and the slot of this model's adapter in its table (0: the base)
        self.adapter_set: Any = None
        self.adapter_slot = 0

    # --- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: EncoderConfig | dict[str, Any], **labels: Any) -> PreTrainedEncoder:
        """A randomly initialised model (as transformers initialises it) from an EncoderConfig or a config dict."""
        if isinstance(config, dict):
            config = get_family(config.get("model_type")).config_from_hf(config, "config")
        config.set_labels(**labels, given_by="from_config")
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
                        cache_dir: str | os.PathLike[str] | None = None,
                        base_model: Any = None, gate_data: str | os.PathLike[str] | None = None) -> PreTrainedEncoder:
        """A model folder, or a LoRA adapter folder in PEFT's format (adapter_config.json): its base comes from
        `base_model_name_or_path`, or `base_model=` (a folder, or a loaded model whose tensors are shared).
        dtype="int8" / "auto-int8": the encoder's Linear layers in int8, held to the int8 gate on the built-in
        judged texts and `gate_data` (a file: one text a line, or JSONL with text / text_pair; hfport/int8.py).
        device: "auto" (the first CUDA device when there is one, else the CPU), "cpu", "cuda", "cuda:N" or a
        torch.device; None: the CPU."""
        device = resolve_device(device) if device is not None else None
        folder = hub.resolve(path_or_repo_id, revision=revision, cache_dir=cache_dir)
        if isinstance(dtype, str) and dtype in INT8_DTYPES:
            if INT8_LOADER is None:
                raise ConfigError(f"{folder}: dtype {dtype!r} needs the int8 loader, installed by `import hfport`")
            if is_adapter_folder(folder):
                raise ConfigError(f"{folder}: dtype {dtype!r} quantizes a plain model folder; an adapter's LoRA "
                                  "layers run in float (load it with dtype='bfloat16' or 'auto')")
            fp32 = cls.from_pretrained(folder, num_labels=num_labels, id2label=id2label, label2id=label2id,
                                       problem_type=problem_type, dtype=torch.float32, device=device,
                                       ignore_mismatched_sizes=ignore_mismatched_sizes)
            return INT8_LOADER(fp32, folder, fallback=dtype == "auto-int8", gate_data=gate_data)
        if gate_data is not None:
            raise ConfigError(f"{folder}: gate_data= judges an int8 load; dtype is {dtype!r}")
        if is_adapter_folder(folder):
            if ADAPTER_LOADER is None:
                raise ConfigError(f"{folder}: an adapter folder, and no adapter loader is installed (import hfport)")
            adapted = ADAPTER_LOADER(cls, folder, base_model=base_model, dtype=dtype, device=device,
                                     num_labels=num_labels, id2label=id2label, label2id=label2id,
                                     problem_type=problem_type)
            return adapted
        if base_model is not None:
            raise ConfigError(f"{folder}: base_model= applies to adapter folders (with adapter_config.json) only")
        raw, source = hub.read_config(folder)
        family = get_family(raw.get("model_type"), source)
        config = family.config_from_hf(raw, source)
        config.set_labels(num_labels=num_labels, id2label=id2label, label2id=label2id, problem_type=problem_type,
                          given_by=f"from_pretrained({str(folder)!r})")
        torch_dtype = resolve_dtype(dtype, config, device)
        config.check_size(torch.finfo(torch_dtype).bits // 8)
        checkpoint = hub.Checkpoint.open(folder)  # headers validated before anything is allocated

        with on_meta():
            model = cls(config, family)
        model = model.to(torch_dtype).to_empty(device=device or "cpu")
        asked = " and ".join(f"num_labels={num_labels!r}" if k == "num_labels" else f"id2label ({len(v)} labels)"
                             for k, v in {"num_labels": num_labels, "id2label": id2label}.items() if v is not None)
        model.load_report = model._load(checkpoint, ignore_mismatched_sizes, asked or None)
        return model.eval()

    def _plan(self, checkpoint: hub.Checkpoint) -> tuple[dict[str, str], list[str]]:
        """checkpoint key -> hfport name for the keys this model uses; the rest are returned as unused.

        A key no key map knows is unused when it lies outside what this model computes (a custom extra head,
        say `cls.chain.weight`), as transformers treats it. It is an error when it lies inside: under a body root
        this model builds or under a module of its own head (see `_computed_prefixes`), where a weight the map
        does not know would change the computation if it were skipped."""
        family, prefix = self.family, self.family.prefix + "."
        head_map = family.head_map(self.config, self.task)
        others = [m for t, m in family.head_keys.items() if t != self.task] + [family.ignored_keys]
        inside = self._computed_prefixes(head_map)
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
            if any(m.to_hfport(local)[0] for m in others) or not local.startswith(inside):
                unused.append(key)
            else:
                unknown.append(key)
        if unknown and all(".lora_A." in k or ".lora_B." in k for k in unknown):
            raise CheckpointError(
                f"{checkpoint.folder}: LoRA layers ({', '.join(unknown[:2])}, ...): a checkpoint of a LoRA fine-tune, "
                "which holds the base's weights with its adapter's; load, export or evaluate the run's best/ or "
                "final/ (the adapter in PEFT's format), or --resume the run from it")
        if unknown:
            outer = [p for p in inside if not any(p != q and p.startswith(q) for q in inside)]
            raise CheckpointError(
                f"{checkpoint.folder}: {len(unknown)} key(s) not in the {family.model_type} key map, inside what the "
                f"{self.task} model computes (under {', '.join(outer)}, after the '{prefix}' prefix), where a skipped "
                f"weight would change the outputs: {', '.join(unknown[:10])}")
        return plan, unused

    def _computed_prefixes(self, head_map: KeyMap | None) -> tuple[str, ...]:
        """HF key prefixes (family prefix removed) of what this model computes, read off the key maps.

        Body: the first component of each body pattern whose hfport module this body builds (`embeddings.`,
        `encoder.`, and `pooler.` only where the task has a pooler). Head: the module path of each pattern of
        this task's head (`cls.predictions.`, `cls.predictions.transform.dense.`, ...), so a sibling such as
        `cls.chain.` is outside."""
        built = {name for name, _ in self.body.named_children()}
        roots = {hf.split(".", 1)[0] + "." for hf, ours in self.family.body_keys.table.items()
                 if ours is not None and ours.split(".", 1)[0] in built}
        if head_map is not None and self.head is not None:
            roots |= {hf.rsplit(".", 1)[0] + "." for hf, ours in head_map.table.items() if ours and "." in hf}
        return tuple(sorted(roots))

    @torch.no_grad()
    def _load(self, checkpoint: hub.Checkpoint, ignore_mismatched_sizes: bool, asked: str | None = None
              ) -> LoadReport:
        """The checkpoint's tensors into this model. ASKED: the labels the caller gave from_pretrained (num_labels=5),
        which a head of another size in the checkpoint then contradicts; None: the config's own."""
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
        bad: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []  # (key, name, checkpoint's, model's)
        for name, key in list(chosen.items()):
            theirs, ours = checkpoint.shape(key), tuple(params[name].shape)
            if theirs != ours:
                if ignore_mismatched_sizes and name.startswith(FRESH_OK_PREFIXES):
                    report.mismatched.append((key, theirs, ours))
                    del chosen[name]
                else:
                    bad.append((key, name, theirs, ours))
        if bad:
            raise CheckpointError(f"{checkpoint.folder}: shape mismatch: "
                                  + "; ".join(f"{key}: checkpoint {list(theirs)} vs model {list(ours)} ({name})"
                                              for key, name, theirs, ours in bad)
                                  + f". {self._mismatch_remedy(bad, asked)}")
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
        if report.unexpected:  # transformers names them too; they stay in the file, the model ignores them
            log.warning("%s: unused checkpoint keys, not part of the %s model (%d): %s", checkpoint.folder,
                        self.task, len(report.unexpected), ", ".join(report.unexpected))
        if missing:
            owners = {n.rsplit(".", 1)[0] for n in missing}
            for mod_name, module in self.named_modules():
                if mod_name in owners:
                    init_module(module, self.config.initializer_range)
            log.warning("%s: initialised fresh, train before use: %s", checkpoint.folder, ", ".join(missing))
        return report

    def _mismatch_remedy(self, bad: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]], asked: str | None
                         ) -> str:
        """What to do about weights of other shapes than the model's, true wherever the load came from: only
        from_pretrained takes labels and ignore_mismatched_sizes, while a pipeline, `hfport predict`, evaluate,
        info, export and serve load a folder as its config.json describes it and never start a head fresh (its
        answers would be random); fine-tuning always starts a head of another size fresh."""
        if any(not name.startswith(FRESH_OK_PREFIXES) for _, name, _, _ in bad):
            return "config.json does not describe these weights (the body's sizes come from it alone): correct it " \
                   "to the checkpoint's sizes"
        n = self.config.num_labels
        counts = {theirs[0] for _, _, theirs, ours in bad if ours and ours[0] == n and theirs and theirs[0] != n}
        m = f"{counts.pop()} labels" if len(counts) == 1 else "another size"
        if asked is not None:  # from_pretrained's own arguments asked for the other head
            return f"{asked} asks for a head of {n} labels, the checkpoint's has {m}: pass " \
                   "ignore_mismatched_sizes=True to start that head fresh (to fine-tune it), or leave the labels " \
                   "out to load the trained one"
        return f"config.json names {n} labels, the checkpoint's head has {m}: to load the trained head, correct " \
               "config.json's id2label and label2id to its labels; a head of another size is trained, not loaded: " \
               "`hfport finetune` and hfport.finetune() start one fresh from this folder, as from_pretrained " \
               "does with ignore_mismatched_sizes=True for a training loop of your own"

    def tied_weights(self) -> dict[str, Tensor | None]:
        """hfport names the checkpoint may carry (transformers holds them as tensors of their own) that this model
        shares with another weight instead, with that weight: a tied MLM decoder's (fill-mask's head, the pre-training
        heads' `mlm`) are the word embeddings and the head's bias (older files repeat it under the decoder's name)."""
        tied: dict[str, Tensor | None] = {}
        for name, module in self.named_modules():
            if isinstance(module, MaskedLMHead) and module.decoder is None:
                tied[f"{name}.decoder.weight"] = self.body.word_embeddings.weight
                tied[f"{name}.decoder.bias"] = module.bias
        return tied

    def tied_names(self) -> set[str]:
        """hfport names the checkpoint may carry that this model shares with another weight instead."""
        return set(self.tied_weights())

    # --- saving -------------------------------------------------------------------------------------------

    def hf_names(self) -> dict[str, str]:
        """hfport name -> the name transformers gives the same tensor for this family and task."""
        family = self.family
        body_prefix = "" if self.head is None else family.prefix + "."  # transformers' bare models: no prefix
        head_map = family.head_map(self.config, self.task)
        out: dict[str, str] = {}
        for name in self.state_dict():
            part, local = name.split(".", 1)
            to_hf = family.body_keys.to_hf if part == "body" else head_map.to_hf if head_map else (lambda n: None)
            hf = to_hf(local)
            if hf is None and local.count(".") >= 2:
                # a module an adapter hangs under a mapped layer (LoRA's `attn.q.lora_A.weight`) is named under
                # that layer's HF name, as PEFT names it (`attention.self.query.lora_A.weight`)
                layer, sub, leaf = local.rsplit(".", 2)
                owner = to_hf(layer + ".weight")
                hf = owner.removesuffix("weight") + f"{sub}.{leaf}" if owner else None
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
        if any(isinstance(m, Int8Linear) for m in self.modules()):  # quantized at load, from the fp32 folder
            raise ConfigError(f"{target}: an int8 model (dtype='int8') is not saved; save the fp32 model it was "
                              "loaded from, and load that with dtype='int8'")
        with staged(target, merge=True, stale=hub.STALE_WEIGHTS) as staging:
            hub.save_weights(self.hf_state_dict(), staging, max_shard_size)
            config = self.config.to_hf_dict(self.family.architectures[self.task])
            config["dtype"] = str(self.dtype).removeprefix("torch.")
            config.pop("torch_dtype", None)
            hub.write_json_atomic(staging / "config.json", config)
        return target

    # --- facts --------------------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype_name(self) -> str:
        """How the model computes, as the server reports it: "int8" when its Linear layers were quantized at load
        (dtype="int8"; their float parts in self.dtype), else the parameters' dtype name ("bfloat16", ...)."""
        if any(isinstance(m, Int8Linear) for m in self.modules()):
            return "int8"
        return str(self.dtype).removeprefix("torch.")

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def gradient_checkpointing_enable(self, enabled: bool = True) -> None:
        """Recompute each encoder layer's activations in the backward pass instead of keeping them
        (torch.utils.checkpoint, non-reentrant; the RNG state is replayed, so dropout masks and gradients are the
        same as without it). Only while training with gradients; inference is unchanged."""
        for module in self.modules():
            if isinstance(module, EncoderLayer):
                module.checkpointed = bool(enabled)

    @property
    def padding_free(self) -> bool:
        """True (the default): batches with padding run on their real tokens only (nn/layout.py); padding
        positions of token-level outputs are then zeros (hidden states) or what the head makes of zeros."""
        return self.body.padding_free

    @padding_free.setter
    def padding_free(self, value: bool) -> None:
        self.body.padding_free = bool(value)

    def get_input_embeddings(self) -> nn.Embedding:
        """The word-embedding table (transformers' name; the MLM head's decoder shares it when tied)."""
        return self.body.word_embeddings

    def _body(self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None,
              position_ids: Tensor | None, encoder_outputs: tuple[Tensor, Tensor | None] | None = None
              ) -> tuple[Tensor, Tensor | None]:
        """(hidden (B, T, C), pooled (B, C) or None): the body's, or `encoder_outputs` when the caller computed
        them already (a mixed-adapter batch's body, run once for every adapter's rows: Pipeline.forward_batch)."""
        if encoder_outputs is not None:
            return encoder_outputs
        return self.body(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         position_ids=position_ids, adapters=self.adapter_route(input_ids))

    def adapter_route(self, input_ids: Tensor) -> Route | None:
        """Every row to this model's adapter in the AdapterSet it was adopted by (None: no adapter set, or the base),
        so the model computes its adapter wherever it is called."""
        if self.adapter_set is None or not self.adapter_slot:
            return None
        slots = torch.full(input_ids.shape[:1], self.adapter_slot, dtype=torch.long, device=input_ids.device)  # (B,)
        return Route(self.adapter_set.table, slots)


def legacy_name(key: str) -> str:
    """Old TF-converted checkpoints call LayerNorm's weight and bias gamma and beta."""
    if key.endswith(".gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith(".beta"):
        return key[: -len("beta")] + "bias"
    return key


def task_of(family: Family, architectures: list[str]) -> str:
    """The canonical task of a config.json's `architectures` (the bare encoder's for classes hfport lacks)."""
    by_class = {cls_name: task for task, cls_name in family.architectures.items()}
    for arch in architectures:
        if arch in by_class:
            return by_class[arch]
    for arch in architectures:  # e.g. RobertaForCausalLM: the body is what hfport can use
        if not isinstance(arch, str):
            raise ConfigError(f"architectures entry {arch!r} is not a string")
    return BASE_TASK


def max_positions(body: nn.Module) -> int | None:
    """How many tokens BODY's absolute position table holds (None: no table, as rotary families)."""
    embeddings = getattr(body, "embeddings", None)
    table = getattr(embeddings, "position", None)
    if table is None or not hasattr(table, "num_embeddings"):
        return None
    offset = 0
    if getattr(embeddings, "positions_offset_by_padding", False):  # RoBERTa: positions start at pad_token_id + 1
        offset = (getattr(embeddings, "pad_token_id", 0) or 0) + 1
    return table.num_embeddings - offset


def folder_max_positions(folder: str | os.PathLike[str]) -> int | None:
    """max_positions of the model in FOLDER (an HF folder), read from its config.json alone: the body built on the
    meta device (no weights read, no memory), so the answer is the one the loaded model's table gives."""
    folder = Path(folder)
    if is_adapter_folder(folder) and not (folder / "config.json").is_file():  # a PEFT adapter: its base's body
        base = read_adapter_config(folder).get("base_model_name_or_path")
        if not base:
            return None  # no base recorded: loading it needs base_model=, which says so
        folder = hub.resolve(base)
    raw, source = hub.read_config(folder)
    family = get_family(raw.get("model_type"), source)
    with on_meta():
        body = family.build_body(family.config_from_hf(raw, source), BASE_TASK)
    return max_positions(body)
