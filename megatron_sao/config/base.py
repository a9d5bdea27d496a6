"""Base class for every section of the config tree (owned by config/; every section module uses it)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def _numeric(annotation: Any) -> bool:
    """int / float (or X | None of them), not bool: a field where a YAML `true` is a mistake, not a number."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = [a for a in args if a is not type(None)] if args else [annotation]
    return bool(kinds) and all(k in (int, float) for k in kinds)


class Section(BaseModel):
    """A config section: unknown keys are errors, attribute docstrings become field descriptions; numbers are
    finite and never booleans (pydantic would read `true` as 1 and accept inf / nan)."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _numeric(field.annotation):
                    raise ValueError(f"{name}={value!r} is a boolean where a number is meant; give a number")
        return data
