"""`hfport convert`: pickled PyTorch weights (pytorch_model.bin, or its shards + index) to safetensors.

The one place hfport reads a pickle, and only when a user asks for it: no loading path calls this. Files are
read with torch's restricted loader (`torch.load(..., weights_only=True)`), which rebuilds tensors and plain
containers and refuses any other object before it is constructed, so a pickle that would run code fails with its
file named and runs nothing. Every tensor is kept under its own name; only an alias of the same storage (a tied
weight) is written once, as transformers does when it saves safetensors. The config and the other small files
are copied; the result is written to a staging folder and renamed into place, so a failure leaves nothing.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import hub
from .errors import CheckpointError, ConfigError
from .modeling import legacy_name
from .registry import get_family
from .staging import staged

# Never copied to the output: weights in other formats and pickles (a .bin beside the weights is often a pickled
# training_args.bin; optimizer.pt, rng_state.pth, ...).
SKIPPED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".h5", ".msgpack", ".safetensors", ".npz")


@dataclass
class ConvertResult:
    out: Path
    sources: list[str]  # the pickled files read
    tensors: int  # tensors written
    dropped: dict[str, str] = field(default_factory=dict)  # tied alias not written -> the name kept for it
    files: list[str] = field(default_factory=list)  # weights files written
    copied: list[str] = field(default_factory=list)  # other files copied as they were
    skipped: list[str] = field(default_factory=list)  # entries of the folder not copied

    def summary(self) -> str:
        lines = [f"wrote {self.tensors} tensors from {', '.join(self.sources)} to {self.out} "
                 f"({', '.join(self.files)})"]
        if self.dropped:
            lines.append("tied (shared storage), written once: "
                         + ", ".join(f"{alias} -> {kept}" for alias, kept in self.dropped.items()))
        if self.copied:
            lines.append(f"copied: {', '.join(self.copied)}")
        if self.skipped:
            lines.append(f"not copied: {', '.join(self.skipped)}")
        return "\n".join(lines)


def convert(folder: str | os.PathLike[str], out: str | os.PathLike[str], *, max_shard_size: int | str = "5GB",
            overwrite: bool = False) -> ConvertResult:
    """Convert FOLDER's pytorch_model.bin (single or sharded) into OUT: model.safetensors (or shards + index),
    config.json and the other non-weight files. OUT must not exist or be empty unless `overwrite`."""
    folder = hub.resolve(folder)
    out = Path(out)
    hub.read_config(folder)  # a folder without a readable config.json would convert into an unusable one
    if out.exists() and out.resolve() == folder.resolve():
        raise CheckpointError(f"{out}: is the folder being converted; give another --out")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out}: exists and is not empty; pass overwrite (--overwrite) to replace its files")
    if (folder / hub.SAFE_WEIGHTS).is_file() or (folder / hub.SAFE_INDEX).is_file():
        raise CheckpointError(f"{folder}: already holds safetensors weights; hfport loads it as it is")

    sources = pickled_files(folder)
    state, owner = {}, {}
    for path in sources:
        for key, tensor in read_pickled_weights(path).items():
            if key in state:
                raise CheckpointError(f"{path}: tensor {key!r} also appears in {owner[key]}")
            state[key], owner[key] = tensor, path.name
    index = folder / hub.PT_INDEX
    if index.is_file():
        listed = set(hub.read_weight_map(index))
        missing = sorted(listed - set(state))
        if missing:
            raise CheckpointError(f"{index}: tensors listed but not in their shard: {missing[:5]}")
    state, dropped = deduplicate(state, tied_source_preference(folder))

    with staged(out, merge=True, stale=hub.STALE_WEIGHTS) as staging:
        files = hub.save_weights(state, staging, max_shard_size)
        copied, skipped = copy_other_files(folder, staging, {p.name for p in sources} | {hub.PT_INDEX})
    return ConvertResult(out, [p.name for p in sources], len(state), dropped, files, copied, skipped)


def pickled_files(folder: Path) -> list[Path]:
    """pytorch_model.bin, or the shards its index names (checked to lie in the folder and exist)."""
    index = folder / hub.PT_INDEX
    if index.is_file():
        paths = []
        for shard in sorted(set(hub.read_weight_map(index).values())):
            if Path(shard).name != shard or shard in (".", ".."):
                raise CheckpointError(f"{index}: shard {shard!r} lies outside the folder")
            if not (folder / shard).is_file():
                raise CheckpointError(f"{index}: shard {shard!r} is missing")
            paths.append(folder / shard)
        return paths
    if (folder / hub.PT_WEIGHTS).is_file():
        return [folder / hub.PT_WEIGHTS]
    raise CheckpointError(f"{folder}: no {hub.PT_WEIGHTS} or {hub.PT_INDEX} to convert")


def read_pickled_weights(path: Path) -> dict[str, torch.Tensor]:
    """A flat name -> tensor dict from one pickled file, through torch's restricted unpickler only."""
    # mmap keeps a large zip-format file on disk instead of in memory; the legacy format cannot be mapped.
    mmap = zipfile.is_zipfile(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # what the restricted loader raises for a forbidden object
        # torch's message mostly advises weights_only=False; only its "WeightsUnpickler error" names the object
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\. Please use|\n\n|$)", str(e), re.DOTALL)
        what = " ".join(found.group(1).split()) if found else "an object that is not a tensor"
        raise CheckpointError(f"{path}: refused by torch's restricted loader (weights_only=True): {what}. The file "
                              "holds something other than tensors and plain containers; hfport does not run it") from e
    except (OSError, RuntimeError, EOFError, ValueError, AttributeError, ImportError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch weights file ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not a dict of tensor names to tensors")
    for key, value in data.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {key!r} is a {type(value).__name__}, not a tensor; "
                                  "only a flat state dict can be converted")
    return data


def tied_source_preference(folder: Path):
    """A sort key over the names of one shared storage: the name to keep first.

    transformers keeps the tie's source (the word embeddings, which the body owns) and drops the aliases of its
    `_tied_weights_keys` (the decoder). Without transformers' classes, the body key map of hfport's family says
    which names the body owns; among the rest, the first in the file wins (the source module is registered, and
    so saved, before the head that ties to it: `cls.predictions.bias` before `cls.predictions.decoder.bias`)."""
    try:
        raw, source = hub.read_config(folder)
        family = get_family(raw.get("model_type"), source)
    except ConfigError:  # not a family hfport knows: the file's order decides alone
        return lambda name, position: (0, position)
    prefix = family.prefix + "."

    def key(name: str, position: int) -> tuple[int, int]:
        in_body = family.body_keys.to_hfport(legacy_name(name.removeprefix(prefix)))[0]
        return (0 if in_body else 1, position)

    return key


def deduplicate(state: dict[str, torch.Tensor], prefer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Write each storage once: names that view the same storage with the same offset, shape and strides are one
    tensor (a tie), kept under the preferred name; other views of a shared storage are copied apart."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault((tensor.device.type, tensor.untyped_storage().data_ptr()), []).append(name)
    position = {name: i for i, name in enumerate(state)}
    out = dict(state)
    dropped: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        views: dict[tuple, list[str]] = {}
        for name in names:
            t = state[name]
            views.setdefault((t.storage_offset(), tuple(t.shape), t.stride(), t.dtype), []).append(name)
        for aliases in views.values():
            aliases.sort(key=lambda n: prefer(n, position[n]))
            for alias in aliases[1:]:
                del out[alias]
                dropped[alias] = aliases[0]
        if len(views) > 1:  # distinct views of one storage: safetensors stores each on its own
            for aliases in views.values():
                out[aliases[0]] = state[aliases[0]].clone()
    return out, dropped


def copy_other_files(folder: Path, target: Path, weights: set[str]) -> tuple[list[str], list[str]]:
    """config.json, tokenizer and other small top-level files as they are; weights, pickles, folders and
    hidden files are left behind (and named)."""
    copied, skipped = [], []
    for item in sorted(folder.iterdir()):
        name = item.name
        if name in weights or name.startswith(".") or not item.is_file() or name.endswith(SKIPPED_SUFFIXES):
            if name not in weights:
                skipped.append(name + ("/" if item.is_dir() else ""))
            continue
        shutil.copyfile(item, target / name)  # follows links: HF cache snapshots hold symlinks into blobs/
        copied.append(name)
    return copied, skipped

