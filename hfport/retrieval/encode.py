"""An embedding model that embeds lists of texts for search: hfport's sentence-embedding pipeline (pooling,
normalization, max_seq_length and prompts as the folder's sentence-transformers files say, texts longer than the model
takes truncated as SentenceTransformer.encode truncates them), the vectors cached on disk by model and text
(cache.py), and a progress bar with an ETA while it embeds.

Prompts follow SentenceTransformer.encode_query / encode_document: a prompt given as text wins, then a prompt name;
with neither, queries take the model's "query" prompt and documents its first of "document", "passage", "corpus"
when it has one, else the model's default_prompt_name (if any).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ItemError
from ..pipelines import SentenceEmbeddingPipeline, check_dtype, pipeline
from ..rundir import RunDir
from .cache import EmbeddingCache

log = logging.getLogger("hfport.retrieval")

ROLE_PROMPTS = {"query": ("query",), "document": ("document", "passage", "corpus")}  # encode_query / _document
CHUNK = 2048  # texts per pipeline call: how often the bar moves and the cache gets a shard


class Encoder:
    """Embeds texts with a sentence-embedding model (a folder, a fine-tune's run folder (its best/), a repo id in the
    local HF cache, or a loaded SentenceEmbeddingPipeline). dtype as `hfport predict --dtype` takes it; cache: True
    (hfport's cache dir), a folder, or False (embed every time)."""

    def __init__(self, model: str | os.PathLike[str] | SentenceEmbeddingPipeline, *, device: Any = None,
                 dtype: str | None = None, batch_size: int | None = None, cache: bool | str | os.PathLike[str] = True,
                 progress: bool = True):
        if isinstance(model, SentenceEmbeddingPipeline):
            self.pipe = model
        else:
            self.pipe = pipeline("sentence-embedding", model=RunDir.model_folder(model), device=device,
                                 dtype=check_dtype(dtype) if dtype is not None else None, batch_size=batch_size)
        # the folder the weights came from: what the cache's key hashes. An ONNX graph (the onnx backend) has no
        # load report, and its folder's safetensors may not be what runs: it is embedded every time, never cached
        report = getattr(self.pipe.model, "load_report", None)
        source = report.source if report is not None else None
        self.folder = Path(source) if source and Path(source).is_dir() else None
        self.dtype = dtype
        self.cache_setting = cache if self.folder is not None else False  # no folder, no identity: no cache
        self.progress = progress
        self._caches: dict[str, EmbeddingCache] = {}

    @property
    def layout(self) -> Any:
        """The folder's sentence-transformers facts (prompts, similarity_fn_name, normalize, ...)."""
        return self.pipe.sentence

    @property
    def device(self) -> Any:
        """Where the model runs: the search runs there too."""
        return self.pipe.model.device

    @property
    def similarity_fn_name(self) -> str:
        return self.layout.similarity_fn_name

    def prompt(self, role: str, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text put before each text of ROLE ("query" or "document"), as encode_query / encode_document pick it."""
        prompts = self.layout.prompts
        if prompt is not None:
            return prompt
        if prompt_name is None:
            prompt_name = next((n for n in ROLE_PROMPTS[role] if n in prompts), self.layout.default_prompt_name)
        if prompt_name is None:
            return ""
        if prompt_name not in prompts:
            raise ValueError(f"prompt name {prompt_name!r}: the model's prompts are {sorted(prompts) or 'none'}")
        return prompts[prompt_name]

    def cache_for(self, prompt: str) -> EmbeddingCache | None:
        if self.cache_setting is False:
            return None
        if prompt not in self._caches:
            root = None if self.cache_setting is True else self.cache_setting
            self._caches[prompt] = EmbeddingCache.for_model(
                self.folder, root, dtype=str(self.dtype), model_dtype=str(self.pipe.model.dtype), prompt=prompt)
        return self._caches[prompt]

    def encode(self, texts: Sequence[str], prompt: str = "", desc: str = "embedding") -> np.ndarray:
        """(N, C) float32: each text's embedding with PROMPT before it, as the model pools (and normalizes) it. Texts
        already in the cache are read from it; the rest are embedded, longest first, a chunk at a time (each chunk
        stored as it is done, so an interrupted run keeps what it embedded)."""
        cache = self.cache_for(prompt)
        found, missing = cache.lookup(texts) if cache is not None else ({}, list(range(len(texts))))
        if found:
            log.info("%s: %d of %d embeddings read from the cache (%s)", desc, len(found), len(texts), cache.folder)
        missing.sort(key=lambda i: -len(texts[i]))  # longest first: each call's batches pad little
        bar = tqdm(total=len(missing), desc=desc, unit="text", disable=not self.progress or not missing,
                   dynamic_ncols=True)
        try:
            for start in range(0, len(missing), CHUNK):
                chunk = missing[start:start + CHUNK]
                vectors = self._embed([texts[i] for i in chunk], prompt)  # (n, C)
                if cache is not None:
                    cache.add([texts[i] for i in chunk], vectors)
                found.update(zip(chunk, vectors))
                bar.update(len(chunk))
        finally:
            bar.close()
        if not texts:
            return np.zeros((0, self.pipe.dimension), dtype=np.float32)
        return np.stack([found[i] for i in range(len(texts))]).astype(np.float32, copy=False)

    def _embed(self, texts: list[str], prompt: str) -> np.ndarray:
        results = self.pipe.predict(texts, truncate=True, prompt=prompt, return_tensors=True)
        for i, r in enumerate(results):
            if isinstance(r, ItemError):
                raise ValueError(f"text {texts[i][:80]!r}: {r.message}")
        return torch.stack(results).numpy()  # (n, C) float32
