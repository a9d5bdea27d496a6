"""Fixtures of the rollout tests: the engines' (tiny HF models, embedded engines in-process or as processes)."""

from tests.engines.conftest import engine_url, routed_engine_url, start_engine, tiny_dirs  # noqa: F401
