"""Fixtures of the weight-sync tests: the learner tests' tiny HF models, and embedded engines as processes."""

from tests.engines.conftest import start_engine  # noqa: F401
from tests.learner.conftest import tiny_hf_dir  # noqa: F401
