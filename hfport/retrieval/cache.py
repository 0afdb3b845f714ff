"""Embeddings kept on disk, keyed by the model and the text, so embedding a corpus again costs a lookup.

Layout, under hfport's cache dir (hardware.cache_root(): $HFPORT_CACHE_DIR, else $XDG_CACHE_HOME/hfport, else
~/.cache/hfport):

    embeddings/<model key>/model.json          what the key was made of (for a person reading the folder)
    embeddings/<model key>/<shard>.npy         (n, C) float32 embeddings, numpy's .npy (never a pickle)
    embeddings/<model key>/<shard>.keys.npy    (n, 16) uint8: each row's text key, blake2b-128 of its UTF-8 bytes

The model key is a hash of what decides the vectors: the model's files (weights by their content, or by the blob name
the HF cache gives a weights file, which is its content hash; config, tokenizer and sentence-transformers files by
content; an adapter's base model too), the dtype it runs in and the prompt put before every text. A shard is written
beside its final name and renamed into place, embeddings first and their keys last, so a shard whose keys file exists
is complete: a killed run leaves nothing half-read, and the next run finds every shard written before it died. Two
runs may add shards to one folder at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import hub
from ..formats.adapter import is_adapter_folder, read_adapter_config
from ..hardware import cache_root

FORMAT = 1  # bumped when what a vector depends on changes in a way the key does not see
MODEL_FILES = (".json", ".txt", ".model", ".safetensors")  # what loading a folder reads (a .bin is never read)
KEY_BYTES = 16
_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> content digest: a file hashed once


def text_keys(texts: Sequence[str]) -> np.ndarray:
    """(N, 16) uint8: each text's key (blake2b-128 of its UTF-8 bytes)."""
    out = np.empty((len(texts), KEY_BYTES), dtype=np.uint8)
    for i, text in enumerate(texts):
        out[i] = np.frombuffer(hashlib.blake2b(text.encode("utf-8"), digest_size=KEY_BYTES).digest(), dtype=np.uint8)
    return out


def _file_digest(path: Path) -> str:
    """A weights file's identity: the HF cache's blob name when the file links to one (the blob is named by its
    sha256), else the sha256 of its bytes (remembered per path, size and mtime for this process)."""
    target = path.resolve()
    if path.is_symlink() and len(target.name) == 64 and all(c in "0123456789abcdef" for c in target.name):
        return target.name
    stat = target.stat()
    memo = (str(target), stat.st_size, stat.st_mtime_ns)
    if memo not in _DIGESTS:
        digest = hashlib.sha256()
        with open(target, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _DIGESTS[memo] = digest.hexdigest()
    return _DIGESTS[memo]


def folder_identity(folder: str | os.PathLike[str]) -> dict[str, str]:
    """{relative path: digest} of the files that decide a loaded model's outputs; an adapter's base folder's files
    too, under "base/"."""
    root = hub.resolve(folder)
    files = {str(p.relative_to(root)): _file_digest(p) for p in sorted(root.rglob("*"))
             if p.is_file() and p.suffix in MODEL_FILES}
    if is_adapter_folder(root):
        base = read_adapter_config(root).get("base_model_name_or_path")
        if base:
            files |= {f"base/{k}": v for k, v in folder_identity(base).items()}
    return files


def model_key(folder: str | os.PathLike[str], **settings: Any) -> tuple[str, dict[str, Any]]:
    """(the key, what it hashes): the folder's files and SETTINGS (dtype, prompt, ... as JSON-able values)."""
    facts = {"format": FORMAT, "files": folder_identity(folder), **{k: settings[k] for k in sorted(settings)}}
    key = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]
    return key, facts


class EmbeddingCache:
    """One model key's folder of embedding shards: `lookup` finds texts' vectors, `add` stores new ones."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.folder = Path(folder)
        self._index: dict[bytes, tuple[int, int]] | None = None  # text key -> (shard, row)
        self._shards: list[Path] = []

    @classmethod
    def for_model(cls, model_folder: str | os.PathLike[str], root: str | os.PathLike[str] | None = None,
                  **settings: Any) -> EmbeddingCache:
        """The cache of MODEL_FOLDER run with SETTINGS (dtype, prompt, ...), under ROOT (default: hfport's cache
        dir's embeddings/)."""
        key, facts = model_key(model_folder, **settings)
        cache = cls(Path(root) if root is not None else cache_root() / "embeddings")
        cache.folder = cache.folder / key
        cache.folder.mkdir(parents=True, exist_ok=True)
        facts_file = cache.folder / "model.json"
        if not facts_file.is_file():
            staging = cache.folder / f".model.{uuid.uuid4().hex[:8]}.tmp"
            staging.write_text(json.dumps({"model": str(model_folder), **facts}, indent=1))
            os.replace(staging, facts_file)
        return cache

    def _load_index(self) -> dict[bytes, tuple[int, int]]:
        if self._index is None:
            self._index, self._shards = {}, []
            for keys_file in sorted(self.folder.glob("*.keys.npy")):
                vectors = keys_file.with_name(keys_file.name[:-len(".keys.npy")] + ".npy")
                if not vectors.is_file():
                    continue
                self._add_shard(vectors, np.load(keys_file, allow_pickle=False))
        return self._index

    def _add_shard(self, vectors: Path, keys: np.ndarray) -> None:
        shard = len(self._shards)
        self._shards.append(vectors)
        for row, key in enumerate(keys):
            self._index.setdefault(key.tobytes(), (shard, row))  # type: ignore[union-attr]

    def __len__(self) -> int:
        return len(self._load_index())

    def lookup(self, texts: Sequence[str]) -> tuple[dict[int, np.ndarray], list[int]]:
        """({position: vector} of the texts found, the positions of those not found)."""
        index = self._load_index()
        found: dict[int, np.ndarray] = {}
        missing: list[int] = []
        wanted: dict[int, list[tuple[int, int]]] = {}  # shard -> [(position, row)]
        for position, key in enumerate(text_keys(texts)):
            hit = index.get(key.tobytes())
            if hit is None:
                missing.append(position)
            else:
                wanted.setdefault(hit[0], []).append((position, hit[1]))
        for shard, pairs in wanted.items():
            vectors = np.load(self._shards[shard], mmap_mode="r", allow_pickle=False)  # (n, C), read as needed
            rows = vectors[np.asarray([r for _, r in pairs])]  # (m, C)
            for (position, _), vector in zip(pairs, rows):
                found[position] = vector
        return found, missing

    def add(self, texts: Sequence[str], vectors: np.ndarray) -> None:
        """Store TEXTS' vectors (N, C) as one new shard."""
        if len(texts) != len(vectors):
            raise ValueError(f"{len(texts)} texts but {len(vectors)} vectors")
        if not len(texts):
            return
        keys = text_keys(texts)
        name = uuid.uuid4().hex
        final = self.folder / f"{name}.npy"
        self._write(final, np.ascontiguousarray(vectors, dtype=np.float32))
        self._write(self.folder / f"{name}.keys.npy", keys)  # last: its presence says the shard is complete
        if self._index is not None:
            self._add_shard(final, keys)

    @staticmethod
    def _write(path: Path, array: np.ndarray) -> None:
        staging = path.with_name(f".{path.name}.tmp")
        with open(staging, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(staging, path)

