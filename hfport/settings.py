"""hfport's settings: the library's in one pydantic-settings class, read from HFPORT_* environment variables once per
process, and what every settings class of hfport shares (the server's subclasses `EnvSettings` too).

    from hfport.settings import settings
    settings().cache_dir              # $HFPORT_CACHE_DIR, else $XDG_CACHE_HOME/hfport, else ~/.cache/hfport

`settings()` reads the environment on its first call and keeps the answer; `use(**values)` replaces the process's
settings by the current ones with VALUES changed (tests, scripts), `reset()` forgets them (the next call reads the
environment again). A value a setting does not accept, and a variable that is no longer a setting, is a
SettingsError naming the variable, the value and what is accepted (or what replaced it).

Every setting is in one of two groups: common (what most users set) or advanced (limits and tuning with working
defaults). docs/settings.md lists them all, generated from these classes (`python scripts/gen_settings_doc.py`), and
`hfport serve --help` lists their environment names.
"""

from __future__ import annotations

import difflib
import json
import os
import threading
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from .errors import SettingsError

PREFIX = "HFPORT_"
GROUPS = ("common", "advanced")
COMMON = {"group": "common"}
ADVANCED = {"group": "advanced"}
VERBOSITY = ("quiet", "normal", "verbose", "debug", "trace")  # hfport/verbosity.py maps them to logging levels


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' environment source, except that a list setting's value that is not JSON
    (HFPORT_ALLOWED_DIRS=/data) goes on to validation as its text, which refuses it naming the variable, the value and
    what it accepts, instead of failing here with a message that names none of them."""

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            return value


class EnvSettings(BaseSettings):
    """A settings class of hfport: fields read from HFPORT_<NAME> (an empty variable counts as unset), every field in
    a group (json_schema_extra=COMMON or ADVANCED), errors as one SettingsError, and `retired`: variables that are
    no longer settings, each with what replaced it (set, they are an error rather than silently ignored)."""

    # allow_inf_nan: a float setting is finite. inf (or 1e400) passed `gt=0` and broke what reads it away from the
    # settings: HFPORT_JOB_LEASE_S=inf made every job process refuse its own lease margin (inf is not < inf), and
    # HFPORT_BATCH_MAX_WAIT_MS=inf left a partial batch waiting until its requests timed out
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="forbid", env_ignore_empty=True, allow_inf_nan=False)
    retired: ClassVar[dict[str, str]] = {}

    def __init__(self, **values: Any) -> None:
        retired = [f"{name} is no longer a setting: {instead}" for name, instead in type(self).retired.items()
                   if os.environ.get(name)]
        if retired:
            raise SettingsError("; ".join(retired) + " (unset it; docs/settings.md lists the settings)")
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise SettingsError(explain(type(self), e, values)) from None

    @model_validator(mode="before")
    @classmethod
    def _strip(cls, values: Any) -> Any:
        """Surrounding whitespace is no part of a value (pydantic already ignored it around a number, not around a
        word, a path, a bool or a token read from a file with its newline, which then matched no request), and a name
        is taken in any case (canonical_name)."""
        if isinstance(values, dict):
            return {k: canonical_name(cls.model_fields[k], v.strip()) if isinstance(v, str) and k in cls.model_fields
                    else v.strip() if isinstance(v, str) else v for k, v in values.items()}
        return values

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _EnvSource(settings_cls), dotenv_settings, file_secret_settings

    @classmethod
    def env_name(cls, name: str) -> str:
        return f"{PREFIX}{name.upper()}"

    @classmethod
    def env_value(cls, name: str) -> Any:
        """The setting NAME as the environment gives it, validated as its field (unset or empty: its default), without
        reading the other settings or the checks across them: for a process that runs before they are complete
        (server/entrypoint.py makes the token a non-loopback host needs) or needs one value only (a job process's
        store). A value the field does not accept is a SettingsError naming the variable."""
        field = cls.model_fields[name]
        env = cls.env_name(name)
        raw = (os.environ.get(env) or "").strip() or None  # as the class reads it: no surrounding whitespace
        if raw is None:
            return field.get_default(call_default_factory=True)
        raw = canonical_name(field, raw)
        try:
            # a tuple inside the brackets: a starred subscript (X[a, *b]) is Python 3.11 syntax, and hfport supports 3.10
            kind = typing.Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            return TypeAdapter(kind).validate_python(raw)
        except ValidationError as e:
            reason = e.errors()[0]["msg"].removeprefix("Value error, ")
            raise SettingsError(f"{shown(field, env, raw)}: {reason} (accepted: {type_text(field)})") from None


NAMES = {"names": True}  # json_schema_extra of a str setting whose values are names its own validator checks


def _literal_choices(annotation: Any) -> tuple[str, ...]:
    """The strings a Literal in ANNOTATION allows (inside a union, Optional or Annotated too)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return tuple(a for a in args if isinstance(a, str))
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return tuple(c for a in args for c in _literal_choices(a))
    return ()


def takes_names(field: FieldInfo) -> bool:
    """The setting's values are names (a Literal's choices, or a field marked NAMES: device, predict_dtype), which it
    takes in any case; not paths, tokens or URLs, which are taken as written."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return bool(_literal_choices(field.annotation) or extra.get("names"))


def canonical_name(field: FieldInfo, value: str) -> str:
    """VALUE in the canonical spelling where the setting's values are names (HFPORT_ROLE=API is `api`,
    HFPORT_VERBOSITY=Debug is `debug`: verbosity alone took any case, role and predict_dtype did not); a value that
    names no choice, or any value of another setting, unchanged (its validation then names it as given)."""
    for choice in _literal_choices(field.annotation):
        if value.lower() == choice.lower():
            return choice
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return value.lower() if extra.get("names") else value


def shown(field: FieldInfo, name: str, value: Any) -> str:
    """NAME=VALUE as an error names a setting's value; a secret's (json_schema_extra "secret": the token, a database
    URL with its password) stays out of errors and logs."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return f"{name} (its value not shown)" if extra.get("secret") else f"{name}={value!r}"


def unknown_variables(*classes: type[EnvSettings]) -> list[str]:
    """The HFPORT_* variables of this environment that none of CLASSES reads or retires, each with the closest
    setting's variable: a misspelt name is otherwise ignored unseen, its setting left at its default. Only a process
    that knows every class can tell (the server's start: a library-only process does not know the server's)."""
    known = sorted({c.env_name(n) for c in classes for n in c.model_fields} | {r for c in classes for r in c.retired})
    problems = []
    for name in sorted(k for k in os.environ if k.startswith(PREFIX) and k not in known):
        close = difflib.get_close_matches(name, known, n=1)
        problems.append(f"{name} is not a setting" + (f" (did you mean {close[0]}?)" if close else ""))
    return problems


def explain(cls: type[EnvSettings], error: ValidationError, given: dict[str, Any]) -> str:
    """Each problem as the variable (or the argument) with its value, pydantic's reason and what the setting accepts
    (a check across settings says its own message), joined by '; '."""
    problems = []
    for e in error.errors():
        reason = e["msg"].removeprefix("Value error, ")
        if not e["loc"]:  # a model validator: its message names the settings it checks
            problems.append(reason)
            continue
        name = str(e["loc"][0])
        env = cls.env_name(name)
        field = cls.model_fields.get(name)
        if field is None:  # an argument that is no setting
            instead = cls.retired.get(env)
            problems.append(f"{name}: " + (f"no longer a setting: {instead}" if instead else
                                           f"not a setting; the settings: {', '.join(cls.model_fields)}"))
            continue
        where = shown(field, name, given[name]) if name in given else shown(field, env,
                                                                             os.environ.get(env, e.get("input")))
        reason = reason[:1].lower() + reason[1:] if reason.startswith("Input ") else reason  # pydantic's own words
        problems.append(f"{where}: {reason} (accepted: {type_text(field)})")
    return "; ".join(problems)


# --- what a field is, in words: docs/settings.md, serve --help and the errors above --------------------------------


def _annotation_text(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _annotation_text(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_annotation_text(a) for a in args if a is not type(None)]
        return " | ".join(parts) + (" | unset" if type(None) in args else "")
    if origin is list:  # an environment variable gives a list as JSON
        return f"JSON list of {_annotation_text(args[0])}"
    return getattr(annotation, "__name__", str(annotation))


def type_text(field: FieldInfo) -> str:
    """`int >= 1`, `api | worker | all`, `JSON list of Path`: the field's type with its bounds."""
    bounds = []
    for m in field.metadata:
        for kind, attr, sign in ((Ge, "ge", ">="), (Gt, "gt", ">"), (Le, "le", "<="), (Lt, "lt", "<")):
            if isinstance(m, kind):
                bounds.append(f"{sign} {getattr(m, attr)}")
        if isinstance(m, MinLen):
            bounds.append(f"at least {m.min_length} long")
    return " ".join([_annotation_text(field.annotation), ", ".join(bounds)]).strip()


def group(field: FieldInfo) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return str(extra.get("group", ""))


def default_text(field: FieldInfo) -> str:
    """The default as a user would write it; json_schema_extra's "shown_default" where it depends on the machine."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "shown_default" in extra:
        return str(extra["shown_default"])
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:  # a size: its bytes and its MiB or GiB
        return f"{value} ({value / 2**30:g} GiB)" if value % 2**30 == 0 else f"{value} ({value / 2**20:g} MiB)"
    return str(value)


def fields_by_group(cls: type[BaseSettings]) -> dict[str, list[tuple[str, FieldInfo]]]:
    """{group: [(name, field), ...]} in GROUPS order, fields in their class's order."""
    return {g: [(n, f) for n, f in cls.model_fields.items() if group(f) == g] for g in GROUPS}


def markdown(cls: type[EnvSettings], title: str, intro: str) -> str:
    """A section of docs/settings.md: a table per group (name, variable, type, default, meaning), then the retired
    variables and what replaced them."""
    cell = lambda text: text.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = [f"## {title}", "", intro, ""]
    for name, fields in fields_by_group(cls).items():
        lines += [f"### {name.capitalize()}", "", "| name | variable | type | default | meaning |",
                  "|---|---|---|---|---|"]
        lines += [f"| `{n}` | `{cls.env_name(n)}` | `{cell(type_text(f))}` | `{cell(default_text(f))}` | "
                  f"{cell(f.description or '')} |" for n, f in fields]
        lines.append("")
    if cls.retired:
        lines += ["### No longer settings", "", "Set, each of these is an error that says what replaced it.", "",
                  "| variable | instead |", "|---|---|"]
        lines += [f"| `{env}` | {cell(instead)} |" for env, instead in cls.retired.items()]
        lines.append("")
    return "\n".join(lines)


def help_text(cls: type[EnvSettings], title: str) -> list[str]:
    """Every setting of CLS as a `VARIABLE: type, default D` line, a paragraph per group (a command's --help)."""
    return ["\n".join([f"{title} settings, {name}:"] + [f"  {cls.env_name(n)}: {type_text(f)}, default "
                                                         f"{default_text(f)}" for n, f in fields])
            for name, fields in fields_by_group(cls).items()]


# --- the library's settings ------------------------------------------------------------------------------------


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hfport"


class Settings(EnvSettings):
    """The library's settings (the CLI, fine-tuning, job processes and every rank of a multi-process launch: the
    environment reaches them all)."""

    verbosity: Literal[VERBOSITY] | None = Field(  # type: ignore[valid-type]
        None, json_schema_extra=COMMON, description=(
            "how much hfport says: quiet (errors only, no progress bar), normal (warnings and the progress bar), "
            "verbose (what a run is doing), debug (every library's debug records), trace (also one record per "
            "optimizer step); unset: the command's default (normal; verbose for `serve` and its job processes). "
            "A command's -q / -v flags win (`serve`'s in the job processes it starts too)"))
    cache_dir: Path = Field(
        default_factory=_default_cache_dir, json_schema_extra={**COMMON, "shown_default":
                                                                "$XDG_CACHE_HOME/hfport, else ~/.cache/hfport"},
        description="hfport's cache: hardware.json (the measured CPU capabilities), int8/ (the int8 gate's "
                    "verdicts, reused by a later dtype=\"int8\" load of the same model), int8-paths/ (dtype="
                    "\"auto-int8\"'s graph exports and its choice among them), embeddings/ (hfport mine, evaluate), "
                    "encoded/ (large training sources, encoded), teacher/ (a distillation teacher's outputs) and "
                    "spill/ (a ranking source's groups)")
    store_max_bytes: int = Field(
        20 * 2**30, ge=0, json_schema_extra=ADVANCED, description=(
            "the cap, each, of the stores under cache_dir/encoded/ (encoded examples) and of those under "
            "cache_dir/teacher/ (a teacher's outputs): after a store is written, the least recently used others "
            "there are evicted while they hold more (never one a process has open); 0: no cap"))

    retired: ClassVar[dict[str, str]] = {
        "HFPORT_STREAM_BYTES": "fixed: a source of 256 MiB or more is encoded to disk (hfport/train/stored.py "
                               "STREAM_BYTES, which scripts/bench_data_rss.py sets per mode)",
        "HFPORT_STORE_WAIT_S": "fixed: a process waits up to 2 h for another writing the same store "
                               "(hfport/train/stored.py STORE_WAIT_S)",
        "HFPORT_PACKED_LINEAR": "pipeline(..., packed_linear=False) (hfport.for_inference's step)",
        "HFPORT_ROW_SHARDS": "pipeline(..., row_shards=\"off\" or a number)",
        "HFPORT_ROW_BUCKETS": "removed: no gain on a default path (docs/benchmarks.md)",
        "HFPORT_INT8_MIN_ROWS": "the min_rows argument of hfport.int8.quantize_loaded",
    }

    @field_validator("cache_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()


_current: Settings | None = None
_lock = threading.Lock()


def settings() -> Settings:
    """This process's library settings, read from the environment on the first call."""
    global _current
    with _lock:
        if _current is None:
            _current = Settings()
        return _current


def use(**values: Any) -> Settings:
    """Replace this process's settings by the current ones with VALUES changed (validated as the environment's
    values are); returns them. For tests and scripts; reset() goes back to the environment."""
    global _current
    changed = Settings(**{**settings().model_dump(), **values})
    with _lock:
        _current = changed
    return changed


def reset() -> None:
    """Forget the settings read or set so far: the next settings() reads the environment again."""
    global _current
    with _lock:
        _current = None
