"""Family lookup by config.json's model_type. The table itself is built in hfport/models/__init__.py."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError
from .models import FAMILIES
from .models.family import Family

__all__ = ["FAMILIES", "Family", "get_family", "supported"]


def get_family(model_type: Any, source: str = "config.json") -> Family:
    if model_type is None:
        raise ConfigError(f"{source}: required field 'model_type' is missing; supported: {supported()}")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported; supported: {supported()}")
    return family


def supported() -> list[str]:
    return sorted(FAMILIES)
