"""Environments (tasks, tools, rewards) behind the plug-in interface in base.py; importing this registers the
built-ins: arithmetic (calculator tool, multi-turn), key_chain (lookup tool, long-tailed multi-turn: the agentic
main task), style_preference (switching target), verifiable_answer."""

from megatron_sao.rollout.envs import arithmetic, key_chain, style_preference, verifiable_answer  # noqa: F401
from megatron_sao.rollout.envs.base import REGISTRY, Environment, Episode, StepResult, env_class, make_env, register

__all__ = ["REGISTRY", "Environment", "Episode", "StepResult", "env_class", "make_env", "register"]
