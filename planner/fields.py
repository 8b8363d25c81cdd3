"""Typed reading of JSON/YAML objects with errors that name the offending field.

Every loader of a shared type (ModelSpec, ClusterSpec, Plan, Profile) reads through `Fields`, so a bad
file is always rejected with a message such as ``plan.parallel.tp: expected a positive integer, got -1``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from meshplan.planner.errors import InputError

_MISSING = object()


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Fields:
    """A view of one JSON object at `path` (e.g. ``plan.parallel``)."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, dict):
            raise InputError(f"{path}: expected an object, got {_show(data)}")
        self.data = data
        self.path = path

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _MISSING:
            raise InputError(f"{self.path}.{key}: missing (required field)")
        return default

    def fail(self, key: str, expected: str, value: Any) -> InputError:
        return InputError(f"{self.path}.{key}: expected {expected}, got {_show(value)}")

    def int(self, key: str, *, min: int | None = None, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, "an integer", value)
        if min is not None and value < min:
            what = "a positive integer" if min == 1 else f"an integer >= {min}"
            raise self.fail(key, what, value)
        return value

    def float(self, key: str, *, min: float | None = None, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, "a number", value)
        if min is not None and value < min:
            raise self.fail(key, f"a number >= {min}", value)
        return float(value)

    def str(self, key: str, *, choices: Iterable[str] | None = None, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if value is None and default is None:
            return None  # type: ignore[return-value]
        if not isinstance(value, str):
            raise self.fail(key, "a string", value)
        if choices is not None:
            choices = tuple(choices)
            if value not in choices:
                raise self.fail(key, "one of " + ", ".join(choices), value)
        return value

    def bool(self, key: str, *, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, "true or false", value)
        return value

    def obj(self, key: str, *, default: Any = _MISSING) -> Fields:
        value = self._get(key, default)
        return Fields(value, f"{self.path}.{key}")

    def list(self, key: str, *, default: Any = _MISSING) -> list:
        value = self._get(key, default)
        if not isinstance(value, list):
            raise self.fail(key, "a list", value)
        return value

    def number_map(self, key: str, *, default: Any = _MISSING) -> dict[str, float]:
        """An object whose values are all numbers (e.g. per-dtype FLOP/s, per-term times)."""
        sub = self.obj(key, default=default)
        return {k: sub.float(k) for k in sub.data}
