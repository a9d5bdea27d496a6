"""Reading the config tree: YAML/TOML files, dotted command-line overrides, errors that name field and fix."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from megatron_sao.config.tree import SAOConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message names each bad field and how to fix it."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a .yaml/.yml/.toml file into a plain dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"config file {path}: unknown extension {path.suffix!r}; use .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """`["--algo.dis.eps_high", "5.0", "--learner.seed=3"]` -> {"algo.dis.eps_high": 5.0, "learner.seed": 3}.

    Values are parsed as YAML scalars/flow collections (`true`, `null`, `[1, 2]`, `{a: 1}`).
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r} must look like --section.key VALUE or --section.key=VALUE")
        key = arg[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value; write --{key} VALUE")
            raw = args[i + 1]
            i += 2
        try:
            out[key] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override --{key}: cannot parse value {raw!r}: {e}") from e
    return out


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Set each dotted key inside the nested dict (creating sections as needed); returns `data`."""
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override --{dotted}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _section_class(path: Sequence[str | int]) -> type[BaseModel] | None:
    cls: type[BaseModel] = SAOConfig
    for key in path:
        field = cls.model_fields.get(str(key))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        cls = field.annotation
    return cls


def _describe(err: Mapping[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    where = ".".join(loc)
    if err["type"] == "extra_forbidden":
        cls = _section_class(loc[:-1])
        known = sorted(cls.model_fields) if cls else []
        guess = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"; did you mean {'.'.join([*loc[:-1], guess[0]])!r}?" if guess else ""
        listing = f" (known keys here: {', '.join(known)})" if known and not guess else ""
        return f"{where}: unknown key{hint}{listing}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if "input" in err and err["type"] != "value_error" and not isinstance(err["input"], dict):
        msg = f"{msg} (got {err['input']!r})"
    return f"{where}: {msg}" if where else msg


def validate_config(data: Mapping[str, Any], source: str = "config") -> SAOConfig:
    """Validate a plain dict into the typed tree, turning pydantic errors into one ConfigError."""
    try:
        return SAOConfig.model_validate(dict(data))
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ConfigError(f"invalid {source}:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] | Mapping[str, Any] = ()) -> SAOConfig:
    """Read `path` (or start from defaults), apply overrides (CLI list or dotted mapping), validate."""
    data = read_config_file(path) if path is not None else {}
    extra = overrides if isinstance(overrides, Mapping) else parse_overrides(overrides)
    apply_overrides(data, extra)
    return validate_config(data, source=str(path) if path else "config")


def config_to_yaml(cfg: SAOConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
