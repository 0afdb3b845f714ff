"""HF checkpoint names <-> hfport parameter names, one table per family.

A table maps HF patterns to hfport patterns. `{i}`, `{j}`, ... stand for layer indices and must appear on
both sides; `None` on the right drops the key (buffers, pre-training heads). The export direction is the
same table read backwards: the first HF pattern listed for an hfport name wins, later ones are aliases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PLACEHOLDER = re.compile(r"\{([a-z])\}")


def _compile(pattern: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(pattern)  # literal, name, literal, name, ...
    regex = "".join(re.escape(p) if k % 2 == 0 else f"(?P<{p}>\\d+)" for k, p in enumerate(parts))
    return re.compile(regex + r"\Z")


@dataclass(frozen=True)
class _Rule:
    src: re.Pattern[str]
    dst: str | None


class KeyMap:
    """An ordered table of `pattern -> pattern | None` rules, applicable in both directions."""

    def __init__(self, table: dict[str, str | None]):
        self.table = dict(table)
        for hf, ours in self.table.items():
            if ours is not None and set(_PLACEHOLDER.findall(hf)) != set(_PLACEHOLDER.findall(ours)):
                raise ValueError(f"key map rule {hf!r} -> {ours!r}: placeholders differ on the two sides")
        self._forward = [_Rule(_compile(hf), ours) for hf, ours in self.table.items()]
        inverse: dict[str, str] = {}
        for hf, ours in self.table.items():
            if ours is not None:
                inverse.setdefault(ours, hf)  # first listed HF name is the canonical one
        self._inverse = [_Rule(_compile(ours), hf) for ours, hf in inverse.items()]

    @staticmethod
    def _apply(rules: list[_Rule], key: str) -> tuple[bool, str | None]:
        for rule in rules:
            m = rule.src.match(key)
            if m:
                return True, None if rule.dst is None else rule.dst.format(**m.groupdict())
        return False, None

    def to_hfport(self, hf_key: str) -> tuple[bool, str | None]:
        """(matched, hfport name or None when the rule drops the key)."""
        return self._apply(self._forward, hf_key)

    def to_hf(self, name: str) -> str | None:
        """The canonical HF name of an hfport parameter, or None if the table does not know it."""
        return self._apply(self._inverse, name)[1]

    def __or__(self, other: KeyMap) -> KeyMap:
        return KeyMap({**self.table, **other.table})


def params(hf: str, ours: str, names: tuple[str, ...] = ("weight", "bias")) -> dict[str, str]:
    """`{hf}.weight -> {ours}.weight` and the same for bias: one line per module in a family table."""
    return {f"{hf}.{n}": f"{ours}.{n}" for n in names}


def tables(*parts: dict[str, str | None]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for part in parts:
        out.update(part)
    return out


def under(table: dict[str, str | None], prefix: str) -> dict[str, str | None]:
    """TABLE with its hfport names moved under PREFIX: a head made of other heads (the pre-training heads' `mlm.`,
    whose names are fill-mask's table's)."""
    return {hf: None if ours is None else prefix + ours for hf, ours in table.items()}
