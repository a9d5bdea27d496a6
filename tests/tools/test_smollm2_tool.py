"""tools/smollm2.py's carry to a GPU machine (benchmarks/gpu_check.sh step 4): `shape_only` copies a model directory
without its weights, `random_weights` fills it with weights of the same names and shapes, and refuses a directory
with no config by naming the command that makes one. (The GGUF conversion itself: tests/models/test_smollm2.py.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from safetensors import safe_open

from megatron_sao.models.tiny import make_tiny_model

_spec = importlib.util.spec_from_file_location("smollm2_tool", Path(__file__).parents[2] / "tools" / "smollm2.py")
smollm2 = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(smollm2)  # type: ignore[union-attr]


def _shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            out.update({n: tuple(st.get_slice(n).get_shape()) for n in st.keys()})  # noqa: SIM118
    return out


def test_a_shape_only_copy_gets_random_weights_of_the_same_shapes(tmp_path: Path) -> None:
    made = make_tiny_model("llama", tmp_path / "made", seed=1, tie_embeddings=True)
    shape = smollm2.shape_only(Path(made), tmp_path / "shape")
    assert (shape / "config.json").is_file() and (shape / "tokenizer.json").is_file()
    assert not list(shape.glob("*.safetensors"))
    smollm2.random_weights(shape)
    assert _shapes(shape) == _shapes(Path(made))
    with pytest.raises(SystemExit, match="--shape-only"):
        smollm2.random_weights(tmp_path / "empty")
