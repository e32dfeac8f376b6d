"""``ConfigReader``: typed reads of a ``config.json``, each problem an error naming the file and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from butter_core.errors import ModelLoadError

_MISSING = object()
MAX_SIZE = 2**31
"""Sizes must be below this: MLX's array dimensions are 32-bit signed integers."""


class ConfigReader:
    """Reads keys of one parsed config (``source`` is its path, for messages); a key that is
    absent or null takes the default given, and without one is a ModelLoadError."""

    def __init__(self, config: dict[str, Any], source: Path):
        self.config = config
        self.source = source

    def fail(self, message: str) -> NoReturn:
        raise ModelLoadError(f"{self.source}: {message}")

    def value(self, key: str, default: Any = _MISSING) -> Any:
        value = self.config.get(key)
        if value is None:
            if default is _MISSING:
                self.fail(f"required key {key!r} is missing")
            return default
        return value

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < MAX_SIZE:
            self.fail(f"{key!r} must be a positive integer below 2**31, got {value!r}")
        return value

    def count(self, key: str, default: Any = _MISSING) -> int:
        """A non-negative integer (0 allowed: no experts, no groups of something)."""
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SIZE:
            self.fail(f"{key!r} must be a non-negative integer below 2**31, got {value!r}")
        return value

    def require_silu(self) -> None:
        """Fail unless the config's ``hidden_act`` is silu (the default), the only one supported."""
        if self.value("hidden_act", "silu") != "silu":
            self.fail(f"hidden_act {self.config.get('hidden_act')!r} is not supported; supported: silu")

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(f"{key!r} must be a number, got {value!r}")
        return float(value)

    def floats(self, key: str, count: int, default: Any = _MISSING) -> tuple[float, ...]:
        """``count`` numbers; an infinity may be written as JSON's ``Infinity`` or, as transformers 5
        saves it, ``{"__float__": "Infinity"}``."""
        value = self.value(key, default)
        numbers = [_number(v) for v in value] if isinstance(value, list | tuple) else []
        if len(numbers) != count or None in numbers:
            self.fail(f"{key!r} must be {count} numbers, got {value!r}")
        return tuple(numbers)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.value(key, default)
        if not isinstance(value, bool):
            self.fail(f"{key!r} must be true or false, got {value!r}")
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        value = self.value(key, default)
        if not isinstance(value, str):
            self.fail(f"{key!r} must be a string, got {value!r}")
        return value


def _number(value: Any) -> float | None:
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
        if value not in ("Infinity", "-Infinity", "NaN"):
            return None
        return float(value.lower().replace("infinity", "inf"))
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
