"""LoRA adapters on hfport's task models, saved and loaded in PEFT's format.

The layer and what it does to a module tree (wrap, merge) are hfport/nn/lora.py's; PEFT's folder layout (file names,
adapter_config.json and its checks, the target-matching rule) is hfport/formats/adapter.py's; which task a PEFT
task_type is, the task records' (hfport/tasks/). This module puts them together on task models, and is the public
`hfport.lora` (every name it has had stays importable here). peft is needed only to *prove* compatibility
(hfport/export/peft.py, tests): an adapter folder hfport writes is loaded by
`peft.PeftModel.from_pretrained(transformers.AutoModelFor<Task>.from_pretrained(base), folder)` and computes what
hfport computes.

    apply_lora       wrap the target linear layers of a task model; freeze everything but LoRA and the task head
                     (PEFT's modules_to_save: the head is trained in full and saved with the adapter)
    save_adapter     adapter_config.json + adapter_model.safetensors under PEFT's key names
                     (`base_model.model.<HF module>.lora_A.weight`, the head as `base_model.model.classifier.weight`)
                     + config.json (labels) beside them
    load_adapter     an adapter folder over its base (`base_model_name_or_path`, or a given folder or a loaded
                     model whose tensors are then shared, not copied); every `<Task>.from_pretrained(adapter folder)`
                     comes here (this module installs it as modeling's ADAPTER_LOADER)
    merged           a plain model with B A folded into W (new tensors: a shared base is never written)
    AdapterSet       many adapters over one loaded base, run together: each adapter's model shares the base's body
                     (its layers made MixedLinear, hfport/nn/lora.py) and keeps its own head; a mixed batch runs the
                     body once with a slot per row (`run_body`, a Route passed to the body) and each head on its rows
                     (the body's output passed to the model as `encoder_outputs`). Adding or removing an adapter swaps
                     an immutable table: the base is never reloaded and a forward pass in flight is not disturbed

Targets are named in hfport names (`attn.q`, `q`, `ffn.up`, `body.encoder.layers.0.attn.q`) or HF names (`query`,
`attention.self.query`, `bert.encoder.layer.0.attention.self.query`): both are read through the family's key map.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from . import hub, modeling
from .formats.adapter import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, IN_MEMORY_NAMES, PEFT_PREFIX, SUPPORTED_VALUES,
                              in_memory_lora, is_adapter_folder, select_in_memory, selects, suffix_match,
                              weights_path)
from .modeling import BASE_TASK, LoadReport, PreTrainedEncoder, on_meta
from .nn.lora import (AdapterInfo, AdapterTable, LoraError, LoraLinear, LoraWeights, MixingError, Route, has_lora,
                      install_mixed, lora_modules, merged, wrap)
from .registry import get_family
from .staging import staged
from .tasks import PEFT_TASK_TYPES, TASKS_OF_PEFT, EncoderModel, adapter_task, read_adapter_config
from .tokenizer import has_tokenizer_files

log = logging.getLogger("hfport")


def _hf_module(hf_names: dict[str, str], module: str) -> str:
    return hf_names[module + ".weight"].removesuffix(".weight")


def _linear_modules(model: PreTrainedEncoder) -> dict[str, nn.Module]:
    """The body's modules with a 2-D weight the key map names (the layers LoRA may wrap, and the rest to refuse)."""
    return {name: m for name, m in model.named_modules() if name.startswith("body.")
            and isinstance(getattr(m, "weight", None), Tensor) and not isinstance(m, LoraLinear)
            and not name.endswith((".lora_A", ".lora_B"))}


def resolve_targets(model: PreTrainedEncoder, targets: list[str] | tuple[str, ...] | None) -> list[str]:
    """hfport module paths of the linear layers `targets` name (hfport or HF names, any suffix of the path)."""
    targets = list(model.family.lora_targets if not targets else targets)  # the family's default: its attention
    hf_names = model.hf_names()
    prefix = model.family.prefix + "."
    modules = _linear_modules(model)
    hf = {name: _hf_module(hf_names, name) for name in modules}
    head = {name for name, _ in model.named_modules() if name.startswith("head.") and
            isinstance(getattr(_, "weight", None), Tensor)}
    head_hf = {name: _hf_module(hf_names, name) for name in head if name + ".weight" in hf_names}
    chosen: list[str] = []
    for target in targets:
        t = target.strip()
        if not t:
            raise LoraError("lora.target_modules: an empty name")
        found = [n for n in modules if any(suffix_match(name, t) for name in (n, hf[n], hf[n].removeprefix(prefix)))]
        if not found:
            in_head = [n for n in head_hf if suffix_match(n, t) or suffix_match(head_hf[n], t)]
            if in_head:
                heads = ", ".join(head_hf[n] for n in in_head)
                raise LoraError(f"lora.target_modules: {t!r} names the task head ({heads}),"
                                " which is trained in full and saved whole (PEFT's modules_to_save)")
            ours = sorted({re.sub(r"^body\.(encoder\.(layers|groups)\.\d+\.(layers\.\d+\.)?)?", "", n)
                           for n, m in modules.items() if isinstance(m, nn.Linear)})
            theirs = sorted({hf[n].rsplit(".", 1)[-1] for n, m in modules.items() if isinstance(m, nn.Linear)})
            raise LoraError(f"lora.target_modules: {t!r} matches no layer of this {model.family.model_type} model; "
                            f"linear layers are {ours} (hfport names) or {theirs} (HF names)")
        not_linear = [n for n in found if not isinstance(modules[n], nn.Linear)]
        if not_linear:
            raise LoraError(f"lora.target_modules: {t!r} matches {hf[not_linear[0]]} "
                            f"({type(modules[not_linear[0]]).__name__}); LoRA applies to linear layers only")
        chosen += [n for n in found if n not in chosen]
    return chosen


def peft_target_names(model: PreTrainedEncoder, targets: list[str]) -> list[str]:
    """PEFT's target_modules for `targets`: per kind of layer (the path without its layer indices), the shortest
    suffix of its HF path that selects exactly the targeted layers under PEFT's rule (name == t or name ends with
    '.' + t), e.g. ["query", "value"], or ["attention.output.dense"] where "dense" alone would catch more."""
    hf_names = model.hf_names()
    every = {k.rsplit(".", 1)[0] for k in hf_names.values() if ".lora_" not in k}
    wanted = {_hf_module(hf_names, t) for t in targets}
    kinds: dict[str, list[str]] = {}
    for t in targets:
        kinds.setdefault(re.sub(r"\.\d+\.", ".#.", t), []).append(_hf_module(hf_names, t))
    out: list[str] = []
    for members in kinds.values():
        parts = members[0].split(".")
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            hit = {m for m in every if suffix_match(m, suffix)}
            if hit <= wanted and set(members) <= hit:
                break
        else:  # no common suffix: name each layer in full
            out += [m for m in members if m not in out]
            continue
        if suffix not in out:
            out.append(suffix)
    selected = {m for m in every if any(suffix_match(m, s) for s in out)}
    assert selected == wanted, (selected ^ wanted)  # the rule above guarantees it
    return out


def modules_to_save(model: PreTrainedEncoder) -> list[str]:
    """The head's top-level HF modules: PEFT's modules_to_save (trained in full, saved whole)."""
    names = model.hf_names()
    out: list[str] = []
    for name in model.state_dict():
        if name.startswith("head."):
            top = names[name].split(".", 1)[0]
            if top not in out:
                out.append(top)
    return out

def apply_lora(model: PreTrainedEncoder, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               targets: list[str] | tuple[str, ...] | None = None, *, use_rslora: bool = False,
               base: str | None = None) -> PreTrainedEncoder:
    """Wrap the target layers of `model` (in place) and freeze all but LoRA and the head; returns the model."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraError(f"lora.r: must be a positive integer, got {r!r}")
    if not alpha or alpha <= 0:
        raise LoraError(f"lora.alpha: must be positive, got {alpha!r}")
    if not 0 <= dropout < 1:
        raise LoraError(f"lora.dropout: must be in [0, 1), got {dropout!r}")
    if lora_modules(model):
        raise LoraError("the model already carries LoRA layers")
    chosen = resolve_targets(model, targets)
    peft_names = peft_target_names(model, chosen)
    saved = modules_to_save(model)
    for p in model.parameters():
        p.requires_grad_(False)
    wrap(model, chosen, r, alpha, dropout, use_rslora)
    for name, p in model.named_parameters():
        if name.startswith("head.") or ".lora_A." in name or ".lora_B." in name:
            p.requires_grad_(True)
    model.adapter = AdapterInfo(r, float(alpha), float(dropout), chosen, peft_names, saved, base, use_rslora)
    return model

# --- saving in PEFT's format -------------------------------------------------------------------------------------


def _tied_values(model: PreTrainedEncoder) -> dict[str, Tensor]:
    """hfport names transformers keeps as separate (tied) tensors, with the tensors they are tied to."""
    return model.tied_weights()  # type: ignore[return-value]


def adapter_state_dict(model: PreTrainedEncoder) -> dict[str, Tensor]:
    """PEFT's saved keys: `base_model.model.<HF name>` for every LoRA tensor and for the whole of each head module
    (as transformers holds it, tied decoder included: what PEFT's modules_to_save copy saves)."""
    names = model.hf_names()
    state = model.state_dict()
    if model.adapter.extra.get("in_memory_names"):  # peft's adapter over transformers' loaded model
        out = in_memory_lora(IN_MEMORY_NAMES[model.family.model_type],
                             {_hf_module(names, path): layer for path, layer in lora_modules(model).items()})
    else:
        out = {PEFT_PREFIX + names[n]: t for n, t in state.items() if ".lora_A." in n or ".lora_B." in n}
    head_map = model.family.head_map(model.config, model.task)
    if head_map is None:
        return out
    roots = set(model.adapter.modules_to_save)
    tied = _tied_values(model)
    for hf, ours in head_map.table.items():
        if ours is None or hf.split(".", 1)[0] not in roots:
            continue
        tensor = state.get("head." + ours, tied.get("head." + ours))
        if tensor is not None:
            out.setdefault(PEFT_PREFIX + hf, tensor)
    return out


def peft_config(model: PreTrainedEncoder, base: str | None) -> dict[str, Any]:
    """adapter_config.json: the fields PEFT's LoraConfig reads (defaults for the rest; no key of hfport's own,
    which peft would warn about)."""
    info = model.adapter
    return {
        "peft_type": "LORA", "task_type": PEFT_TASK_TYPES[model.task], "r": info.r, "lora_alpha": info.alpha,
        "lora_dropout": info.dropout, "target_modules": list(info.peft_targets),
        "modules_to_save": list(info.modules_to_save) or None, "base_model_name_or_path": base, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": info.use_rslora, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "revision": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "auto_mapping": None}


def save_adapter(model: PreTrainedEncoder, folder: str | os.PathLike[str], base: str | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors (PEFT's names) + config.json (the head's labels), written
    into a staging folder and renamed into place."""
    if not has_lora(model):
        raise LoraError("save_adapter: the model carries no LoRA adapter")
    target = Path(folder)
    base = base if base is not None else model.adapter.base
    with staged(target, merge=True, stale=hub.STALE_WEIGHTS) as staging:
        tensors, seen = {}, set()
        for key, value in adapter_state_dict(model).items():
            value = value.detach().contiguous().cpu()
            # PEFT saves tied tensors (decoder bias = head bias) under each name; safetensors wants distinct memory
            tensors[key] = value.clone() if value.data_ptr() in seen else value
            seen.add(value.data_ptr())
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        hub.write_json_atomic(staging / ADAPTER_CONFIG, peft_config(model, base))
        config = model.config.to_hf_dict(model.family.architectures[model.task])
        config.pop("torch_dtype", None)
        config["dtype"] = str(model.dtype).removeprefix("torch.")
        hub.write_json_atomic(staging / "config.json", config)
    return target


def adapter_tokenizer(folder: str | os.PathLike[str], base: str | os.PathLike[str]) -> str:
    """Where an adapter's tokenizer is: its own folder (hfport writes it there), else the base's (PEFT's folders)."""
    return str(folder) if has_tokenizer_files(folder) else str(base)

BODY_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "vocab_size", "embedding_size")


def _check_base(adapter_folder: Path, base_config: Any, adapter_config: Any) -> None:
    wrong = [f"{f} {getattr(adapter_config, f)!r} (adapter) vs {getattr(base_config, f)!r} (base)"
             for f in BODY_FIELDS if getattr(adapter_config, f) != getattr(base_config, f)]
    if wrong:
        raise LoraError(f"{adapter_folder}: the adapter was trained on another base model than "
                        f"{base_config.source}: " + "; ".join(wrong))


def check_adapter_base(folder: str | os.PathLike[str], base: str | os.PathLike[str]) -> None:
    """The adapter folder fits the base model folder: its config is valid and the body's sizes agree."""
    folder = Path(folder)
    read_adapter_config(folder)
    base_raw, base_source = hub.read_config(hub.resolve(base))
    base_config = get_family(base_raw.get("model_type"), base_source).config_from_hf(base_raw, base_source)
    if (folder / "config.json").is_file():
        raw, source = hub.read_config(folder)
        _check_base(folder, base_config, get_family(raw.get("model_type"), source).config_from_hf(raw, source))


def load_adapter(cls: type[PreTrainedEncoder], folder: str | os.PathLike[str], *,
                 base_model: str | os.PathLike[str] | PreTrainedEncoder | None = None, dtype: Any = None,
                 device: Any = None, num_labels: int | None = None, id2label: dict[int, str] | None = None,
                 label2id: dict[str, int] | None = None, problem_type: str | None = None) -> PreTrainedEncoder:
    """The model of an adapter folder: the base's body (loaded from `base_model_name_or_path`, `base_model=` a
    folder, or `base_model=` a loaded hfport model whose tensors are then shared, not copied), LoRA layers and the
    trained head from the folder. Every adapter tensor must fit a module of the base and every trainable tensor of
    the model must come from the folder; anything else is an error naming it."""
    folder = Path(folder)
    raw = read_adapter_config(folder)
    task = adapter_task(folder)
    if cls.task != task and cls.task != BASE_TASK:
        raise LoraError(f"{folder}: a {task} adapter; {cls.__name__} computes {cls.task}")
    if cls.task == BASE_TASK and task != cls.task:
        raise LoraError(f"{folder}: a {task} adapter (its head is part of it); load it with its task's class")
    # the base: shared when given loaded, else loaded as the bare encoder (its head, if any, is not used)
    if isinstance(base_model, PreTrainedEncoder):
        base = base_model
        base_name = str(base.load_report.source) if base.load_report else "the given model"
    else:
        base_name = str(base_model) if base_model is not None else raw.get("base_model_name_or_path")
        if not base_name:
            raise LoraError(f"{folder / ADAPTER_CONFIG}: base_model_name_or_path is empty; pass base_model=")
        base = EncoderModel.from_pretrained(base_name, dtype=dtype, device=device)
    if has_lora(base):
        raise LoraError(f"base {base_name}: already carries a LoRA adapter; give the plain base model")
    config = copy.deepcopy(base.config)
    if (folder / "config.json").is_file():
        own_raw, own_source = hub.read_config(folder)
        own = get_family(own_raw.get("model_type"), own_source).config_from_hf(own_raw, own_source)
        _check_base(folder, base.config, own)
        labels = {"id2label": own.id2label, "problem_type": own.problem_type} if own.id2label else {}
        config.set_labels(**labels)
    config.set_labels(num_labels=num_labels, id2label=id2label, label2id=label2id, problem_type=problem_type,
                      given_by=f"from_pretrained({str(folder)!r})")
    with on_meta():
        model = cls(config, base.family)
    # the body: the base's tensors themselves (two adapters over one base hold one copy of its weights)
    theirs = dict(base.body.named_parameters()) | dict(base.body.named_buffers())
    missing_body = []
    for name, tensor in list(model.body.named_parameters()) + list(model.body.named_buffers()):
        if name not in theirs:
            missing_body.append(name)
            continue
        owner, _, leaf = name.rpartition(".")
        module = model.body.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = theirs[name]
        else:
            module._buffers[leaf] = theirs[name]
        if base.load_report and ("body." + name) in base.load_report.initialized:
            missing_body.append(name)
    if missing_body:
        raise LoraError(f"base {base_name}: lacks body weights this {task} adapter uses: {missing_body[:5]}")
    ref = next(base.parameters())
    if model.head is not None:
        model.head.to_empty(device=ref.device)
        model.head.to(ref.dtype)
    # LoRA layers on PEFT's targets (its matching rule on transformers' module names)
    targets_raw = raw["target_modules"]
    chosen, chunked, in_memory = _adapter_targets(model, folder, targets_raw)
    if not chosen:
        raise LoraError(f"{folder / ADAPTER_CONFIG}: target_modules {targets_raw!r} match no layer of the base "
                        f"{base_name} ({model.family.model_type})")
    r, alpha = raw["r"], float(raw.get("lora_alpha", 8))
    with torch.device(ref.device):
        wrap(model, chosen, r, alpha, float(raw.get("lora_dropout", 0.0)), bool(raw.get("use_rslora", False)),
             chunked)
    model.adapter = AdapterInfo(r, alpha, float(raw.get("lora_dropout", 0.0)), chosen,
                                targets_raw if isinstance(targets_raw, list) else [targets_raw],
                                modules_to_save(model), base_name, bool(raw.get("use_rslora", False)), str(folder),
                                extra={"in_memory_names": True} if in_memory else {})
    _load_adapter_tensors(model, folder)
    model.load_report = LoadReport(str(folder), loaded=sorted(n for n, p in model.named_parameters()
                                                              if p.requires_grad or ".lora_" in n),
                                   notes=[f"LoRA adapter (r={r}, alpha={alpha:g}) over {base_name}"])
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _adapter_targets(model: PreTrainedEncoder, folder: Path, targets: str | list[str]
                     ) -> tuple[list[str], dict[str, tuple[int, tuple[int, ...]]], bool]:
    """The layers target_modules selects (PEFT's rule) on the names transformers saves, or on its in-memory names
    where the folder's tensors carry those (formats/adapter.py's select_in_memory): (layers, chunked, in-memory)."""
    hf_names = model.hf_names()
    modules = {n: _hf_module(hf_names, n) for n in _linear_modules(model)}
    saved = [n for n, hf in modules.items() if selects(targets, hf)]
    names = IN_MEMORY_NAMES.get(model.family.model_type)
    chosen, chunked = select_in_memory(names, modules, targets, folder) if names else ([], {})
    return (chosen, chunked, True) if chosen else (saved, {}, False)


@torch.no_grad()
def _load_adapter_tensors(model: PreTrainedEncoder, folder: Path) -> None:
    path = weights_path(folder)  # its header validated against the file size before anything is read
    expected = adapter_state_dict(model)  # peft key -> the model's tensor to fill (or a tied one to compare)
    tied = {id(t) for t in _tied_values(model).values()}
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        unexpected = sorted(set(keys) - set(expected))
        if unexpected:
            raise LoraError(f"{path}: tensors that fit no module of the adapted model: {unexpected[:6]}"
                            + (f" (+{len(unexpected) - 6})" if len(unexpected) > 6 else ""))
        missing = sorted(k for k, t in expected.items() if k not in keys and id(t) not in tied)
        if missing:
            raise LoraError(f"{path}: lacks {len(missing)} tensor(s) the adapter's model needs: {missing[:6]}")
        bad = []
        for key in keys:
            target, tensor = expected[key], f.get_tensor(key)
            if tuple(tensor.shape) != tuple(target.shape):
                bad.append(f"{key}: adapter {list(tensor.shape)} vs base model {list(target.shape)}")
                continue
            if id(target) in tied:  # a copy of a tied weight (PEFT saves the whole head module): must agree
                if not torch.equal(tensor.to(target.dtype), target):
                    raise LoraError(f"{path}: {key} differs from the weight it is tied to in the base "
                                    "(hfport computes the MLM decoder tied to the word embeddings)")
                continue
            target.copy_(tensor)
        if bad:
            raise LoraError(f"{path}: adapter tensors do not fit the base model (a different base? hidden size, "
                            "layer sizes or r): " + "; ".join(bad[:5]))


modeling.ADAPTER_LOADER = load_adapter  # every <Task>.from_pretrained(adapter folder) loads through it

# --- many adapters over one base, in one forward pass ------------------------------------------------------------

def check_targets(name: str, folder: str | os.PathLike[str], model: PreTrainedEncoder) -> None:
    """Every name in the adapter's target_modules list selects a layer of the base (PEFT skips an unmatched one
    silently; serving refuses it, since an adapter trained on other modules would be computed wrong)."""
    targets = read_adapter_config(folder)["target_modules"]
    if isinstance(targets, str):  # a regex: load_adapter checked that it selects something
        return
    hf_names = model.hf_names()
    layers = [_hf_module(hf_names, n) for n in _linear_modules(model)]
    layers += [_hf_module(hf_names, n) for n in lora_modules(model)]
    names = IN_MEMORY_NAMES.get(model.family.model_type)
    layers += [part for layer in layers for part in names.in_memory(layer)] if names else []
    for t in targets:
        if not any(suffix_match(layer, t) for layer in layers):
            raise LoraError(f"adapter {name!r} ({folder}): target module {t!r} is not a layer of the base "
                            f"{model.family.model_type} model")


class AdapterSet:
    """Adapters over one loaded base model, served together. The base model and every adapter's model share one
    body (the base's module, never reloaded); `table` maps each adapter's slot to its LoRA weights and is replaced,
    never edited, so a forward pass in flight keeps the snapshot it started with."""

    def __init__(self, base: PreTrainedEncoder):
        if has_lora(base):
            raise LoraError("AdapterSet: the base carries a LoRA adapter; give the plain base model")
        self.base, self.body = base, base.body
        self.table = AdapterTable()
        self.slots: dict[str, int] = {}  # adapter name -> slot (0 is the base)
        self.mixable = True  # False once the body showed it cannot run several adapters in one pass
        self._next = 1
        self._lock = threading.Lock()
        self.adopt(base, 0)

    def adopt(self, model: PreTrainedEncoder, slot: int) -> PreTrainedEncoder:
        """Make `model` run on the shared body as `slot` (its own head stays): every call of the model then routes its
        rows to its adapter (PreTrainedEncoder.adapter_route)."""
        if model.body is not self.body:
            model.body = self.body
        model.adapter_set, model.adapter_slot = self, slot
        return model

    def load(self, name: str, folder: str | os.PathLike[str], cls: type[PreTrainedEncoder],
             build: Callable[[PreTrainedEncoder], Any] | None = None) -> Any:
        """The `cls` model of the adapter folder, named `name`: the shared body, the folder's head, its LoRA weights
        in the table under its own slot (a name loaded again replaces its weights). `build(model)`, when given, makes
        the caller's object of the model (its pipeline), returned instead of it.

        All or nothing: the set changes only once reading, checking and `build` all worked, so a failed load leaves
        its slots, its table and the shared body's layers as they were, and nothing of the adapter referenced."""
        model = load_adapter(cls, folder, base_model=self.base)
        check_targets(name, folder, model)
        weights = {path: LoraWeights(layer.lora_A.weight, layer.lora_B.weight, layer.scaling)
                   for path, layer in lora_modules(model.body).items()}
        with self._lock:  # held while `build` runs: two loads never take one slot
            slot = self.slots.get(name) or self._next
            table = self.table.with_adapter(slot, weights)
            model = self.adopt(model, slot)  # the new model only: its body becomes the shared one
            built = build(model) if build is not None else model
            install_mixed(self.body, list(weights))  # all layers or none
            self._next = max(self._next, slot + 1)
            self.table = table
            self.slots[name] = slot
        return built

    def remove(self, name: str) -> None:
        """Forget the adapter `name` (a new table without it); the base and the other adapters are untouched."""
        with self._lock:
            slot = self.slots.pop(name, None)
            if slot is not None:
                self.table = self.table.without(slot)

    def run_body(self, slots: Tensor, input_ids: Tensor, attention_mask: Tensor | None,
                 token_type_ids: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The shared body once over a mixed batch, row i with adapter slots[i] (0: the base): (hidden (B, T, C),
        pooled (B, C) or None). A body that cannot mix (MixingError, remembered) runs one pass per adapter."""
        table = self.table  # this pass's snapshot (an adapter added meanwhile swaps in a new table)
        if self.mixable:
            try:
                return self.body(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                 adapters=Route(table, slots))
            except MixingError as e:
                log.info("%s: one forward pass per adapter from now on", e)
                self.mixable = False
        hidden = pooled = None
        for slot in slots.unique().tolist():
            rows = (slots == slot).nonzero().squeeze(1)  # (B_s,)
            part = [t.index_select(0, rows) if t is not None else None
                    for t in (input_ids, attention_mask, token_type_ids)]
            route = Route(table, slots.index_select(0, rows)) if slot else None
            h, p = self.body(part[0], attention_mask=part[1], token_type_ids=part[2], adapters=route)  # (B_s, T, C)
            hidden = h.new_zeros(slots.shape[0], *h.shape[1:]) if hidden is None else hidden  # (B, T, C)
            hidden.index_copy_(0, rows, h)
            if p is not None:
                pooled = p.new_zeros(slots.shape[0], *p.shape[1:]) if pooled is None else pooled  # (B, C)
                pooled.index_copy_(0, rows, p)
        return hidden, pooled


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX", "PEFT_TASK_TYPES", "SUPPORTED_VALUES", "TASKS_OF_PEFT",
           "AdapterInfo", "AdapterSet", "LoraError", "LoraLinear", "MixingError", "adapter_state_dict", "adapter_task",
           "adapter_tokenizer", "apply_lora", "check_adapter_base", "check_targets", "has_lora", "is_adapter_folder",
           "load_adapter", "lora_modules", "merged", "modules_to_save", "peft_config", "peft_target_names",
           "read_adapter_config", "resolve_targets", "save_adapter"]
