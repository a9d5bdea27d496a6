from tests.learner.conftest import tiny_hf_dir  # noqa: F401
