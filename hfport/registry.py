"""Family records, keyed by config.json's model_type. Families register themselves in hfport/models/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from .config import EncoderConfig
from .errors import ConfigError
from .keymap import KeyMap


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers' base_model_prefix: head checkpoints store the body under "<prefix>."
    architectures: dict[str, str]  # task -> transformers class name written to config.json
    config_from_hf: Callable[[dict[str, Any], str], EncoderConfig]
    body_keys: KeyMap
    head_keys: dict[str, KeyMap]  # task -> table of the head's own keys
    build_body: Callable[[EncoderConfig, str], nn.Module]  # (config, task)
    build_head: Callable[[EncoderConfig, str], nn.Module | None]
    ignored_keys: KeyMap = field(default_factory=lambda: KeyMap({}))  # pre-training heads hfport never loads
    after_init: Callable[[nn.Module, EncoderConfig], None] | None = None  # a family's own fresh-init values
    # a family whose head names depend on the config (DeBERTa's two MLM layouts) picks the head's table here
    select_head_keys: Callable[[EncoderConfig, str], KeyMap | None] | None = None

    def head_map(self, config: EncoderConfig, task: str) -> KeyMap | None:
        return self.select_head_keys(config, task) if self.select_head_keys else self.head_keys.get(task)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.model_type in FAMILIES:
        raise ValueError(f"family {family.model_type!r} is registered twice")
    FAMILIES[family.model_type] = family
    return family


def get_family(model_type: Any, source: str = "config.json") -> Family:
    from . import models  # noqa: F401  (registers the families)

    if model_type is None:
        raise ConfigError(f"{source}: required field 'model_type' is missing; supported: {supported()}")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported; supported: {supported()}")
    return family


def supported() -> list[str]:
    from . import models  # noqa: F401

    return sorted(FAMILIES)
