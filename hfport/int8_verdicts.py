"""The int8 gate's verdicts (GateResult, KeptVerdict) and where they are kept: on disk, so that a dtype="int8" load of
the very same model, on the same machine and code, reuses an earlier load's verdict and calibration instead of
judging again (the gate judges the real MiniLM on 256 rows up to 512 tokens: ~10 s at every server start).

Where: `<cache_dir>/int8/<digest of the key>.json` (the setting cache_dir, hfport/settings.py), JSON written
atomically (never pickle). The key is everything the verdict depends on:
  - the model as loaded: the bytes of its fp32 tensors (the weight files' as read, and any head made at load), its
    config and task, the folder's tokenizer files (they cut the judged rows) and its pooling (the embedding gate's);
  - the gate's options: the judged sets (the built-in one and the user's gate_data, as read), the thresholds and
    rules (hfport/agreement.py's, hfport/probes.py's and nn/int8.py's constants, at their values at load time) and
    the calibration texts;
  - the code and the machine: hfport's version and a digest of its source files (an edited checkout reuses nothing
    judged by other code), torch's version, the CPU's name and int8 instructions (hardware.int8_isa), the activation
    granularities this torch runs and the dtype of the float parts.
min_rows and auto-int8's fallback are not in it: the gate judges int8 at every call size, and what a refusal leads to
is the caller's.

What is kept (KeptVerdict): the granularity that passed (None: every one was refused, and each refusal's line), each
judged set's GateResult, the passing calibration (each layer's nn/int8.py LayerPlan: outlier channels, static input
range, shared input) and the gate's statistic on its spot batch (hfport/int8.py).

Never trusted blindly: a file that does not parse, was made for another key, or holds a value out of its range (a
layer the model lacks, a channel past the layer's width, a range that is not finite, a pass with a failed set, ...) is
ignored with a warning, and the gate runs and rewrites it. A kept pass is also checked before use (hfport/int8.py:
its spot batch must give the kept statistic again); a kept refusal is used as it is (a wrong one costs int8's speed,
never its quality).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import agreement, hardware, hub, probes
from .nn import int8 as int8_nn
from .nn.int8 import LayerPlan
from .settings import settings
from .tokenizer import TOKENIZER_FILES
from .version import __version__

log = logging.getLogger("hfport")

FOLDER = "int8"  # under the setting cache_dir
FORMAT = 1  # bumped when a kept verdict's layout changes: older files are another key's
PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class GateResult:
    data: str  # where the judged texts came from
    kind: str  # "texts", "pairs", "long texts" or "long pairs"
    statistic: str  # the gate's tolerance, e.g. "min cosine >= 0.98"
    value: float
    items: int
    bound: float  # the threshold the statistic is held to
    passed: bool
    tokens: tuple[int, int] = (0, 0)  # the shortest and longest judged row, in tokens

    def line(self) -> str:
        return (f"{self.statistic}: {self.value:.4f} over {self.items} {self.kind} of {self.tokens[0]}-"
                f"{self.tokens[1]} tokens ({self.data}){'' if self.passed else ' FAILED'}")


@dataclass(frozen=True)
class KeptVerdict:
    """The gate's verdict on one model, as kept: ACTIVATIONS the granularity that passed (None: all refused), the
    last judged granularity's RESULTS, the lines of the granularities REFUSED before, the passing calibration PLAN
    by layer name ({} when refused) and SPOT, the statistic on the spot batch (None when refused)."""

    activations: str | None
    results: list[GateResult]
    refused: list[str] = field(default_factory=list)
    plan: dict[str, LayerPlan] = field(default_factory=dict)
    spot: float | None = None
    path: Path | None = None  # the file it was read from or written to


# --- the key ------------------------------------------------------------------------------------------------------


def _sha256(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
    return h.hexdigest()


def tensors_digest(model: nn.Module) -> str:
    """The bytes of every tensor MODEL saves, with its name, dtype and shape."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def files_digest(folder: Path, names: tuple[str, ...]) -> str:
    """The bytes of those of NAMES that FOLDER has, by name (read in blocks: weight files can be large)."""
    h = hashlib.sha256()
    for name in names:
        if (folder / name).is_file():
            h.update(f"{name} {(folder / name).stat().st_size}\n".encode())
            with (folder / name).open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()


@functools.cache
def code_digest() -> str:
    """hfport's own source files (its version does not move while a checkout is edited)."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(f"{path.relative_to(PACKAGE).as_posix()}\n".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def key(model: Any, folder: Path, datasets: list[probes.GateData], pooling: str, granularities: tuple[str, ...],
        float_dtype: torch.dtype) -> dict[str, Any]:
    """What the gate's verdict on MODEL (fp32, just loaded from FOLDER) depends on (the module docstring), as JSON
    values (a kept file's key compares equal to it)."""
    rules = {name.lower(): getattr(module, name) for module, names in (
        (agreement, ("MIN_AGREEMENT", "MIN_COSINE", "NEAR_TIE", "SCORE_TIE", "MAX_SCORE_ERROR", "TOP_K")),
        (probes, ("PROBE_MAX_LENGTH", "MIN_JUDGED", "GATE_CHUNK", "GATE_TOKENS", "LONG_FROM", "SEED")),
        (int8_nn, ("QMAX", "EPS", "OUTLIER_RATIO", "MAX_OUTLIERS", "U8_MARGIN", "STABLE_RATIO"))) for name in names}
    return {
        "format": FORMAT,
        "hfport": __version__, "code": code_digest(), "torch": torch.__version__,
        "cpu": hardware.cpu_name(), "int8_isa": hardware.int8_isa(),
        "granularities": list(granularities), "float_dtype": str(float_dtype).removeprefix("torch."),
        "task": model.task,
        "weights": tensors_digest(model),
        "config": _sha256(_json(dataclasses.asdict(model.config))),
        "tokenizer": files_digest(folder, TOKENIZER_FILES),
        "pooling": pooling,
        "judged": [_sha256(_json(dataclasses.asdict(data))) for data in datasets],
        "calibration": _sha256(_json([probes.CALIBRATION_TEXTS, probes.CALIBRATION_PAIRS])),
        "rules": rules,
    }


def path_for(key: dict[str, Any]) -> Path:
    return settings().cache_dir / FOLDER / f"{_sha256(_json(key))[:32]}.json"


# --- reading (checked) and writing --------------------------------------------------------------------------------


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _number(value: Any, what: str) -> float:
    _expect(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            f"{what}: {value!r} is not a finite number")
    return float(value)


def _result(raw: Any, n: int) -> GateResult:
    names = [f.name for f in dataclasses.fields(GateResult)]
    _expect(isinstance(raw, dict) and sorted(raw) == sorted(names), f"results[{n}]: expected the fields {names}")
    tokens = raw["tokens"]
    _expect(all(isinstance(raw[k], str) for k in ("data", "kind", "statistic")), f"results[{n}]: a name not a string")
    _expect(isinstance(raw["items"], int) and raw["items"] > 0 and isinstance(raw["passed"], bool),
            f"results[{n}]: items or passed")
    _expect(isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, int) and t > 0 for t in tokens),
            f"results[{n}]: tokens {tokens!r}")
    return GateResult(raw["data"], raw["kind"], raw["statistic"], _number(raw["value"], f"results[{n}].value"),
                      raw["items"], _number(raw["bound"], f"results[{n}].bound"), raw["passed"], tuple(tokens))


def _layer(name: str, raw: Any, linear: nn.Linear, names: set[str]) -> LayerPlan:
    _expect(isinstance(raw, dict) and sorted(raw) == ["input_range", "outliers", "shares_input_with"],
            f"plan[{name}]: expected outliers, input_range and shares_input_with")
    outliers, span, shares = raw["outliers"], raw["input_range"], raw["shares_input_with"]
    _expect(isinstance(outliers, list) and len(set(outliers)) == len(outliers) <= int8_nn.MAX_OUTLIERS and
            all(isinstance(c, int) and 0 <= c < linear.in_features for c in outliers),
            f"plan[{name}].outliers: {outliers!r} are not distinct channels of its {linear.in_features}")
    if span is not None:
        _expect(isinstance(span, list) and len(span) == 2, f"plan[{name}].input_range: {span!r}")
        lo, hi = (_number(v, f"plan[{name}].input_range") for v in span)
        _expect(lo <= 0.0 <= hi and lo < hi, f"plan[{name}].input_range: {span!r} does not hold 0 inside")
        span = (lo, hi)
    _expect(shares is None or shares in names, f"plan[{name}].shares_input_with: {shares!r} is no layer")
    return LayerPlan(tuple(outliers), span, shares)


def _verdict(raw: Any, linears: dict[str, nn.Linear], granularities: list[str]) -> KeptVerdict:
    _expect(isinstance(raw, dict), "no verdict")
    activations = raw.get("activations")
    _expect(activations is None or activations in granularities, f"activations {activations!r}")
    results = raw.get("results")
    _expect(isinstance(results, list) and results, "no results")
    results = [_result(r, n) for n, r in enumerate(results)]
    refused = raw.get("refused")
    _expect(isinstance(refused, list) and all(isinstance(r, str) for r in refused), "refused")
    plan = raw.get("plan")
    _expect(isinstance(plan, dict), "no plan")
    if activations is None:
        _expect(not plan and refused and not all(r.passed for r in results), "a refusal with a plan or no failure")
        return KeptVerdict(None, results, refused)
    _expect(all(r.passed for r in results), "a pass with a failed set")
    _expect(plan.keys() == linears.keys(), f"plan: layers {sorted(plan.keys() ^ linears.keys())} not the model's")
    plan = {name: _layer(name, layer, linears[name], set(plan)) for name, layer in plan.items()}
    return KeptVerdict(activations, results, refused, plan, _number(raw.get("spot"), "spot"))


def read(key: dict[str, Any], linears: dict[str, nn.Linear]) -> KeptVerdict | None:
    """The verdict kept for KEY, checked against the model's encoder LINEARS; None where there is none, or where the
    file is not one to trust (logged: the gate runs and rewrites it)."""
    path = path_for(key)
    if not path.is_file():
        return None
    try:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        _expect(isinstance(raw, dict) and raw.get("key") == key, "made for another key")
        kept = _verdict(raw.get("verdict"), linears, key["granularities"])
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        log.warning("int8 gate: %s ignored (%s); the gate runs and rewrites it", path, e)
        return None
    return dataclasses.replace(kept, path=path)


def write(key: dict[str, Any], kept: KeptVerdict) -> KeptVerdict:
    """KEPT on disk under KEY (atomically: a temporary file, then a rename); a cache dir that cannot be written only
    costs the next load the gate (logged)."""
    path = path_for(key)
    verdict = {"activations": kept.activations, "results": [dataclasses.asdict(r) for r in kept.results],
               "refused": kept.refused, "spot": kept.spot,
               "plan": {name: dataclasses.asdict(layer) for name, layer in kept.plan.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        hub.write_text_atomic(path, json.dumps({"key": key, "verdict": verdict}, indent=1) + "\n")
    except OSError as e:
        log.warning("int8 gate: could not keep its verdict in %s (%s); the next load judges again", path, e)
        return kept
    return dataclasses.replace(kept, path=path)
