"""Where checkpoints come from and go to: local folders, the local HF cache, safetensors (single or sharded).

Every safetensors header is parsed and checked against the file size before a tensor is read, so a truncated
or forged file fails with its name instead of a crash or a huge allocation. Pickle files are never opened.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import CheckpointError, ConfigError, ModelNotFoundError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
# what a save into an existing folder removes if it did not write it: weights of an earlier save in another layout
# (one file then, shards now, or the reverse)
STALE_WEIGHTS = ("model*.safetensors*",)
PT_WEIGHTS = "pytorch_model.bin"  # pickled: read only by `hfport convert`, never by a loading path
PT_INDEX = "pytorch_model.bin.index.json"
PICKLE_WEIGHTS = (PT_WEIGHTS, PT_INDEX, "tf_model.h5", "flax_model.msgpack")
# Only these are fetched from a hub cache: config, tokenizer files and safetensors, never pickles.
ALLOWED_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.md"]

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit


def resolve(path_or_repo_id: str | os.PathLike[str], *, revision: str | None = None,
            cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A local folder as is; otherwise a repo id looked up in the local HF cache (HF_HOME honoured).

    Nothing is downloaded while HF_HUB_OFFLINE is set; without it, only config, tokenizer and safetensors
    files would be fetched."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    name = str(path_or_repo_id)
    if path.exists():
        raise ModelNotFoundError(f"{name}: is a file; give the folder that holds config.json")
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not name.strip():
        raise ModelNotFoundError(f"{name}: no such folder")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ModelNotFoundError(f"{name}: not a folder, and huggingface_hub is not installed") from e
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                      allow_patterns=ALLOWED_PATTERNS))
    except LocalEntryNotFoundError:
        pass
    except Exception as e:  # invalid repo id and the like
        raise ModelNotFoundError(f"{name}: not a folder and not a repo id in the local HF cache ({e})") from e
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"{name}: not a local folder and not in the local HF cache ({cache_dir or constants.HF_HUB_CACHE}); "
            "HF_HUB_OFFLINE is set, so nothing is downloaded")
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, allow_patterns=ALLOWED_PATTERNS))
    except Exception as e:
        raise ModelNotFoundError(f"{name}: not a local folder, not in the local HF cache, and the download "
                                 f"failed: {e}") from e


def read_config(folder: Path) -> tuple[dict[str, Any], str]:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    return raw, str(path)


# --- reading -------------------------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor table of a safetensors file, checked entry by entry against the file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes); not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} is larger than the file ({size} bytes); "
                                  "truncated or corrupt")
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {n} exceeds {MAX_HEADER_BYTES} bytes")
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the header is not JSON ({e})") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    data_size = size - 8 - n
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise CheckpointError(f"{path}: tensor {key!r}: entry needs dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor {key!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {key!r}: bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{path}: tensor {key!r}: bad data_offsets {offsets!r}")
        if offsets[1] > data_size:
            raise CheckpointError(f"{path}: tensor {key!r} ends at byte {offsets[1]} but the data section has "
                                  f"{data_size} bytes; the file is truncated")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CheckpointError(f"{path}: tensor {key!r}: {offsets[1] - offsets[0]} bytes do not hold "
                                  f"{dtype} {shape}")
        tensors[key] = entry
    return tensors


def pickle_advice(folder: Path, pickles: list[str]) -> str:
    """What to do with a folder of pickled weights: loading never unpickles; `hfport convert` does, on request."""
    advice = ("hfport reads safetensors only and loading never unpickles files (a pickle can run code). "
              "If you trust where it came from, convert it once, keeping every tensor and the config: "
              f"`hfport convert {folder} --out {folder}-safetensors` (it reads with torch's restricted loader, "
              "weights_only=True, and writes model.safetensors).")
    if not any(p.startswith("pytorch_model.bin") for p in pickles):  # TF / Flax files: not convert's input
        advice += " `hfport convert` reads pytorch_model.bin files only; convert TF or Flax weights with transformers."
    return advice


def read_weight_map(index: Path, kind: str = "a weights index") -> dict[str, str]:
    """An index file's weight_map (tensor name -> shard file name); KIND names the file in the error."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not {kind} (needs a 'weight_map' object): {e}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
    return weight_map


@dataclass
class Checkpoint:
    """The tensors of a folder, by name, read lazily from their (validated) files."""

    folder: Path
    files: dict[str, Path] = field(default_factory=dict)  # tensor name -> file
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)  # tensor name -> header entry

    @classmethod
    def open(cls, folder: Path) -> Checkpoint:
        ckpt = cls(folder)
        index = folder / SAFE_INDEX
        if index.is_file():
            weight_map = read_weight_map(index, "a safetensors index")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                # Checked by name, not by resolved path: HF cache snapshots hold symlinks into ../../blobs.
                if Path(shard).name != shard or shard in (".", ".."):
                    raise CheckpointError(f"{index}: shard {shard!r} lies outside the folder")
                shard_path = folder / shard
                if not shard_path.is_file():
                    raise CheckpointError(f"{index}: shard {shard!r} is missing")
                ckpt._add(shard_path)
            missing = sorted(set(weight_map) - set(ckpt.files))
            if missing:
                raise CheckpointError(f"{index}: tensors listed but not in their shard: {missing[:5]}")
        elif (folder / SAFE_WEIGHTS).is_file():
            ckpt._add(folder / SAFE_WEIGHTS)
        else:
            pickles = [p for p in PICKLE_WEIGHTS if (folder / p).exists()]
            if pickles:
                raise CheckpointError(f"{folder}: holds only {', '.join(pickles)}; " + pickle_advice(folder, pickles))
            raise CheckpointError(f"{folder}: no {SAFE_WEIGHTS} or {SAFE_INDEX}")
        return ckpt

    def _add(self, path: Path) -> None:
        for key, entry in read_safetensors_header(path).items():
            if key in self.files:
                raise CheckpointError(f"{path}: tensor {key!r} also appears in {self.files[key]}")
            self.files[key] = path
            self.entries[key] = entry

    def keys(self) -> list[str]:
        return list(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key]["shape"])

    def tensors(self, keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) file by file, each file opened once."""
        by_file: dict[Path, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.files[key], []).append(key)
        for path, names in by_file.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in names:
                        yield name, f.get_tensor(name)
            except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # SafetensorError: an Exception only
                raise CheckpointError(f"{path}: cannot be read: {e}") from e


# --- writing -------------------------------------------------------------------------------------------------


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    for unit, mult in sorted(units.items(), key=lambda u: -len(u[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def check_output_file(path: str | os.PathLike[str], what: str) -> Path:
    """PATH as a file to write WHAT to, checked before the work that makes it: not a folder, and no part of its
    folder an existing file (either would fail only once the work is done, as an OSError). Missing folders are made
    when it is written."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: a folder; name a file to write {what} to")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{path}: {parent} is a file, not a folder to write {what} in")
            break
    return path


def atomic_temporaries(path: Path) -> list[Path]:
    """The temporary files write_text_atomic left beside PATH: a writer killed between its write and its rename (no
    `finally` runs under SIGKILL) leaves one. Only names of its pattern, `.<name>.<12 hex digits>.tmp`; the caller
    knows no live writer of PATH is left."""
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{12}}\.tmp\Z")
    return sorted(p for p in path.parent.iterdir() if pattern.match(p.name) and p.is_file())


def write_text_atomic(path: Path, text: str) -> None:
    """TEXT at PATH, whole or not at all: written beside it under a temporary name of this writer's own (two processes
    or threads writing one file each rename a file of theirs; a shared temporary name let one rename the other's,
    or find it gone) and renamed into place; the temporary file is removed when the write or the rename fails (a
    killed writer's is left: atomic_temporaries finds it)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only where the write or the rename failed


def write_json_atomic(path: Path, data: Any) -> None:
    """DATA as JSON at PATH, whole or not at all (write_text_atomic)."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_weights(state: dict[str, torch.Tensor], folder: Path, max_shard_size: int | str = "5GB") -> list[str]:
    """Write `state` (already in HF names) as model.safetensors or shards + index. Each file is written
    under a temporary name and renamed into place, so a crash never leaves a half-written weights file."""
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and used + nbytes > limit:
            shards.append({})
            used = 0
        shards[-1][name] = tensor.detach().contiguous().cpu()
        used += nbytes
    names = [SAFE_WEIGHTS] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, name in zip(shards, names):
        tmp = folder / f".{name}.tmp"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / name)
    stale = [SAFE_INDEX] if len(shards) == 1 else [SAFE_WEIGHTS]
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        weight_map = {k: n for shard, n in zip(shards, names) for k in shard}
        write_json_atomic(folder / SAFE_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    for name in stale:
        (folder / name).unlink(missing_ok=True)
    return names
