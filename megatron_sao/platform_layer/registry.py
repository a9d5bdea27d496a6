"""The list of CPU patches: each names the megatron-core (or torch) function it works around, why, and the
megatron-core versions it was checked on. Owned by platform/; `activate()` applies them in order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Patch:
    name: str
    """Short identifier, shown by `python -m megatron_sao platform`."""
    works_around: str
    """The megatron-core / torch function(s) whose behaviour is replaced."""
    why: str
    """The exact failure without the patch."""
    apply: Callable[[], None]
    checked_on: tuple[str, ...] = ("0.16.1",)
    """megatron-core versions on which the patch was checked (tests/platform/)."""
    tags: tuple[str, ...] = field(default_factory=tuple)


PATCHES: list[Patch] = []


NO_TE = "no-te"
"""Tag of a patch whose failure comes from Transformer Engine being absent, not from the CPU: a GPU without TE (the
local spec, e.g. fp32 on GPUs, or a machine without TE installed) needs it too."""


def register(
    name: str, works_around: str, why: str, checked_on: tuple[str, ...] = ("0.16.1",), tags: tuple[str, ...] = ()
):
    """Decorator: add the decorated zero-argument function to PATCHES."""

    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        PATCHES.append(Patch(name=name, works_around=works_around, why=why, apply=fn, checked_on=checked_on,
                             tags=tags))  # fmt: skip
        return fn

    return deco
