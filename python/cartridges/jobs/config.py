"""The training config of a datablock: the library's `TrainConfig` defaults, overridden field
by field by the request's `config` (one set of defaults for library, CLI and server)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from ..selfstudy.config import TrainConfig

# docs/api.md §2 names the learning rate `learning_rate`; TrainConfig calls it `lr`.
ALIASES = {"learning_rate": "lr"}


class ConfigError(ValueError):
    """A config the API refuses with 400; `param` names the field (e.g. "config.epochs")."""

    def __init__(self, param: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def field_types() -> dict[str, tuple[type, bool]]:
    """Each TrainConfig field's type, and whether it may be null (None: decided automatically)."""
    out = {}
    for f in fields(TrainConfig):
        names = [part.strip() for part in str(f.type).split("|")]
        out[f.name] = (_TYPES[names[0]], "None" in names)
    return out


def train_config_from_request(overrides: dict[str, Any] | None) -> TrainConfig:
    """TrainConfig defaults with `overrides` applied; unknown fields and wrong types refused."""
    types = field_types()
    values: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        name = ALIASES.get(key, key)
        if name not in types:
            raise ConfigError(f"config.{key}", f"Unknown config field '{key}'.", code="unknown_parameter")
        if name in values:
            raise ConfigError(f"config.{key}", f"'{key}' is given twice (also as its alias).")
        expected, nullable = types[name]
        values[name] = None if value is None and nullable else _checked(key, value, expected)
    try:
        return TrainConfig(**values)
    except ValueError as error:
        raise ConfigError("config", f"Invalid config: {error}.") from None


def _checked(key: str, value: Any, expected: type) -> Any:
    """JSON numbers and booleans as the field's type; ints are accepted for float fields."""
    ok = (
        isinstance(value, bool)
        if expected is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool)
        if expected is float
        else isinstance(value, expected) and not isinstance(value, bool)
    )
    if not ok:
        raise ConfigError(f"config.{key}", f"Invalid value for 'config.{key}': expected {expected.__name__}.")
    return float(value) if expected is float else value


def base_model_id(model_path: str | Path | None) -> str:
    """The id clients see for the server's base model, as `cartridges.Model` names it: the
    GGUF file's stem or the Hugging Face directory's name."""
    if model_path is None:
        from ..models.default import DEFAULT_GGUF

        return DEFAULT_GGUF.removesuffix(".gguf")
    path = Path(model_path)
    return path.name.removesuffix(".gguf") if path.suffix == ".gguf" else path.name
