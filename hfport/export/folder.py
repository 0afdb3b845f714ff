"""`export(src, out)`: SRC as an HF folder that transformers loads.

OUT gets the layout transformers writes: config.json (the source config with the trained head's metadata and the
hfport version), model.safetensors (or shards + index) under transformers' key names, the tokenizer files, and a
README.md model card; a source in the sentence-transformers layout keeps it (export/sentence_transformers.py). Everything is written into a hidden sibling folder and renamed into place at the end, so no
failure (a full disk included) leaves a half-written OUT; an existing OUT is only replaced with `force`. With
verify=True the staged folder is proven against SRC (export/verify.py) before it is renamed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .. import hub, lora
from ..modeling import PreTrainedEncoder
from ..tasks import load_any
from ..tokenizer import copy_tokenizer_files
from .card import model_card
from .common import (DTYPE_NAMES, EXPORT_DTYPES, WHICH, ExportError, check_places, export_config,
                     no_tokenizer_message, replace_folder, resolve_source, staged, tokenizer_folder)
from .sentence_transformers import copy_layout as copy_st_layout
from .verify import VerifyFailed, VerifyReport
from .verify import verify as verify_folder

log = logging.getLogger("hfport")


class ExportOptions(BaseModel):
    """How to export: the options `hfport export`, `hfport.export()` and the server's export jobs share.

    (Where to write, whether to replace it, verify and the report path are the caller's, not options.)"""

    model_config = ConfigDict(extra="forbid")

    which: Literal["best", "final"] = Field("best", description="a run's best/ or final/ model")
    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="the dtype the weights are stored in")
    max_shard_size: int | str = Field("5GB", description="shard the weights above this size (bytes, or '500MB')")
    atol: float | None = Field(None, description="verify's absolute tolerance (default by dtype)")
    rtol: float | None = Field(None, description="verify's relative tolerance (default by dtype)")

    @field_validator("which", mode="before")
    @classmethod
    def _which(cls, v: Any) -> Any:
        if v not in WHICH:
            raise ValueError(f"which={v!r}: expected one of {list(WHICH)}")
        return v

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        if v not in EXPORT_DTYPES:
            raise ValueError(f"dtype {v!r}: expected one of {list(EXPORT_DTYPES)}")
        return v

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: int | str) -> int | str:
        try:
            limit = hub.parse_size(v)
        except (ValueError, AttributeError) as e:
            raise ValueError(f"max_shard_size {v!r}: expected bytes or a size like '500MB', '2GB'") from e
        if limit <= 0:
            raise ValueError(f"max_shard_size {v!r}: must be positive")
        return v

    @classmethod
    def of(cls, **values: Any) -> ExportOptions:
        """Validated options; a bad value is an ExportError that names it."""
        try:
            return cls(**values)
        except ValidationError as e:
            problems = "; ".join(str(err["ctx"]["error"]) if "error" in err.get("ctx", {}) else
                                 f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ExportError(problems) from e


@dataclass
class ExportResult:
    out: Path
    source: Path  # the model folder that was exported
    family: str
    task: str
    dtype: str
    files: list[str]  # everything in OUT
    weights: list[str]  # model.safetensors, or the shards
    tokenizer_from: Path
    report: VerifyReport | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: paths as strings, the verify report as its own dict."""
        return {"out": str(self.out), "source": str(self.source), "family": self.family, "task": self.task,
                "dtype": self.dtype, "files": list(self.files), "weights": list(self.weights),
                "tokenizer_from": str(self.tokenizer_from),
                "verify": self.report.to_dict() if self.report is not None else None}


def export(src: str | os.PathLike[str], out: str | os.PathLike[str], *, which: str = "best", dtype: str = "fp32",
           max_shard_size: int | str = "5GB", force: bool = False, verify: bool = False, atol: float | None = None,
           rtol: float | None = None, json_path: str | os.PathLike[str] | None = None,
           merge: bool = False) -> ExportResult:
    """Write SRC as an HF folder at OUT; with verify=True, prove it against SRC before OUT appears.

    A LoRA adapter (SRC's model folder holds adapter_config.json) is exported as the adapter in PEFT's format, or,
    with merge=True, as a plain HF folder with the updates folded in (export/peft.py, with their proofs).

    which, dtype, max_shard_size, atol, rtol: ExportOptions (the same options the CLI and the server take)."""
    options = ExportOptions.of(which=which, dtype=dtype, max_shard_size=max_shard_size, atol=atol, rtol=rtol)
    limit = hub.parse_size(options.max_shard_size)
    source = resolve_source(src, options.which)
    out = Path(out).expanduser()
    check_places(source, out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists; pass --force (force=True) to replace it")
    if lora.is_adapter_folder(source.model):
        from .peft import export_lora

        return export_lora(source, out, merge=merge, dtype=EXPORT_DTYPES[options.dtype], limit=limit, verify=verify,
                           atol=options.atol, rtol=options.rtol, json_path=json_path, replace=replace_folder)
    if merge:
        raise ExportError(f"{source.model}: merge applies to LoRA adapter folders (adapter_config.json); this is a "
                          "plain model")

    model = load_any(source.model, dtype=torch.float32)
    report = model.load_report
    if report is not None and report.initialized:
        raise ExportError(f"{source.model}: lacks weights the {model.family.architectures.get(model.task)} model "
                          f"needs ({', '.join(report.initialized[:8])}); hfport would initialise them randomly, so "
                          "the export would not be the trained model")
    if report is not None and report.nonfinite:
        raise ExportError(f"{source.model}: NaN or inf values in {len(report.nonfinite)} weight(s): "
                          f"{', '.join(report.nonfinite[:8])}; refusing to export a broken model")
    if report is not None and report.unexpected:
        log.warning("%s: not exported (the %s head does not use them): %s", source.model, model.task,
                    ", ".join(report.unexpected[:8]))
    architecture = model.family.architectures.get(model.task)
    if architecture is None:
        raise ExportError(f"{source.model}: the {model.family.model_type} family has no transformers class for "
                          f"the {model.task} head")
    tok_folder = tokenizer_folder(source)
    if tok_folder is None:
        raise ExportError(no_tokenizer_message(source))
    torch_dtype = EXPORT_DTYPES[options.dtype]
    task = model.task
    model = model.to(torch_dtype)

    with staged(out) as staging:
        files = hub.save_weights(model.hf_state_dict(), staging, limit)
        config = export_config(model, architecture, torch_dtype)
        del model  # verify loads the source afresh, in float32
        hub.write_json_atomic(staging / "config.json", config)
        copy_tokenizer_files(tok_folder, staging)
        # an embedding model keeps its sentence-transformers modules
        embedding_layout = bool(copy_st_layout(source.model, staging))
        (staging / "README.md").write_text(model_card(source, config, task, out.name,
                                                      embedding_layout=embedding_layout), encoding="utf-8")
        result = ExportResult(out, source.model, config["model_type"], task, DTYPE_NAMES[torch_dtype],
                              sorted(p.name for p in staging.iterdir()), files, tok_folder)
        if verify:
            result.report = verify_folder(staging, source.model, atol=options.atol, rtol=options.rtol,
                                          json_path=json_path, label=str(out))
            if not result.report.passed:
                raise VerifyFailed(f"{out}: the export does not match {source.model}; nothing was written\n"
                                   + result.report.table(), result.report)
    return result

