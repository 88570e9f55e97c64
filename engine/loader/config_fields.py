"""config.json: reading the file, and typed reads of its fields with one-line errors that name the field."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """config.json is missing, unreadable or inconsistent; the message names the field."""


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``model_dir/config.json`` (a JSON object); ``ModelConfigError`` otherwise."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelConfigError(f"model directory {str(path)!r} does not exist or is not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelConfigError(f"model directory {str(path)!r} has no config.json")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{config_path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"cannot read {config_path}: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ModelConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    return raw


class FieldReader:
    """Reads fields of one JSON object; ``error`` is the exception class raised on bad values."""

    def __init__(self, data: Mapping[str, Any], error: type[Exception], prefix: str = ""):
        self.data = data
        self.error = error
        self.prefix = prefix

    def sub(self, name: str) -> FieldReader | None:
        """A reader over the nested object ``name`` (None when absent or null)."""
        value = self.data.get(name)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            self.fail(name, f"must be an object, got {value!r}")
        return FieldReader(value, self.error, f"{self.prefix}{name}.")

    def fail(self, name: str, why: str):
        raise self.error(f"config field '{self.prefix}{name}' {why}")

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def int(self, name: str, default: int, minimum: int = 1) -> int:
        value = self.data.get(name)
        if value is None:
            return default
        return self._int_value(name, value, minimum)

    def positive_int_value(self, name: str, value: Any) -> int:
        return self._int_value(name, value, 1)

    def _int_value(self, name: str, value: Any, minimum: int) -> int:
        # JSON writers sometimes emit 4.0 for 4; accept whole floats, reject bools and fractions.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            self.fail(name, f"must be an integer, got {value!r}")
        if int(value) < minimum:
            self.fail(name, f"must be >= {minimum}, got {value!r}")
        return int(value)

    def optional_int(self, name: str, default: int | None) -> int | None:
        if name not in self.data:
            return default
        value = self.data[name]
        if value is None:
            return None
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        return self._int_value(name, value, 0)

    def int_tuple(self, name: str, default: tuple[int, ...]) -> tuple[int, ...]:
        """An int or a list of ints (``eos_token_id`` comes both ways)."""
        value = self.data.get(name)
        if value is None:
            return default
        values = value if isinstance(value, list) else [value]
        if not values:
            self.fail(name, "must not be an empty list")
        return tuple(self._int_value(name, v, 0) for v in values)

    def int_list(self, name: str, minimum: int = 0) -> list[int]:
        value = self.data.get(name)
        if not isinstance(value, Sequence) or isinstance(value, str):
            self.fail(name, f"must be a list of integers, got {value!r}")
        return [self._int_value(f"{name}[{i}]", v, minimum) for i, v in enumerate(value)]

    def str_list(self, name: str) -> list[str]:
        value = self.data.get(name)
        if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(v, str) for v in value):
            self.fail(name, f"must be a list of strings, got {value!r}")
        return list(value)

    def float(self, name: str, default: float, positive: bool = False) -> float:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(name, f"must be a number, got {value!r}")
        if positive and not value > 0:
            self.fail(name, f"must be > 0, got {value!r}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(name, f"must be true or false, got {value!r}")
        return value

    def choice(self, name: str, default: str, allowed: Sequence[str]) -> str:
        value = self.data.get(name)
        if value is None:
            return default
        if value not in allowed:
            self.fail(name, f"is {value!r}; supported: {', '.join(allowed)}")
        return value
