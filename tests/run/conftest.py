"""Fixtures of the run tests: the learner tests' tiny HF models."""

from tests.learner.conftest import tiny_hf_dir  # noqa: F401
