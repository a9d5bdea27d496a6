"""Environments (tasks, tools, rewards) behind the plug-in interface in base.py; importing this registers the
built-ins: arithmetic (calculator tool, multi-turn), key_chain (lookup tool, long-tailed multi-turn: the agentic
main task), style_preference (switching target), verifiable_answer; env_class / make_env look a name up."""

from __future__ import annotations

import importlib
from typing import Any

from megatron_sao.rollout.envs import arithmetic, key_chain, style_preference, verifiable_answer  # noqa: F401
from megatron_sao.rollout.envs.base import REGISTRY, Environment, Episode, StepResult, register

__all__ = ["REGISTRY", "Environment", "Episode", "StepResult", "env_class", "make_env", "register"]


def env_class(name: str) -> type[Environment]:
    """A registered name (arithmetic, key_chain, style_preference, verifiable_answer) or an import path
    `module:Class`."""
    if ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr, None)
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"{name!r} is not an Environment subclass")
        return cls
    if name not in REGISTRY:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(REGISTRY)}, or use 'module:Class'")
    return REGISTRY[name]


def make_env(name: str, options: dict[str, Any] | None = None) -> Environment:
    return env_class(name)(**(options or {}))
