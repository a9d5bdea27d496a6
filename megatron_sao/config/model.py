"""`model` section: which network the learner trains and the engines serve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from megatron_sao.config.base import Section

ModelFamily = Literal["qwen3_moe", "glm4_moe", "glm_moe_dsa", "qwen3", "llama"]


def read_hf_config_json(path: str | Path) -> dict[str, Any]:
    """An HF model's config.json (`path`: the file or the model directory). ValueError naming the file and the line
    when it is cut short or not a JSON object: every reader of a model's config goes through here, so none reports a
    bare "Expecting value: line 10 column 18"."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): the model's "
                         "config is cut short or damaged; copy it from the model's source again") from None  # fmt: skip
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a text file ({e.reason}): point at the model's config.json") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object: not an HF model config")
    return data


class TinyModelConfig(Section):
    """A tiny random model of `model.family` with a tokenizer (models/tiny.py; tools/make_tiny_model.py's options)."""

    hidden: int = Field(default=64, ge=16, multiple_of=16)
    """Hidden size."""

    layers: int = Field(default=2, ge=1)
    """Transformer layers."""

    experts: int = Field(default=4, ge=1)
    """Routed experts per MoE layer."""

    seed: int = 0
    """Seed of the random weights."""


class ModelConfig(Section):
    hf_path: str | None = None
    """Hugging Face model directory (config.json, safetensors, tokenizer). Engines serve it; the learner
    builds its megatron-core model from its config.json and loads its weights unless `learner.load` is set."""

    family: ModelFamily | None = None
    """Model family; None reads it from config.json's `model_type`."""

    dtype: Literal["bf16", "fp32"] = "bf16"
    """Parameter and compute dtype of the learner (bf16 on GPU; fp32 is exact on CPU)."""

    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    """Keys that replace config.json values before the model is built (e.g. {"num_hidden_layers": 2})."""

    num_experts: int | None = None
    """Routed experts per MoE layer. None reads it from config.json; set, it validates parallel.expert without a
    model directory, and with one it must equal config.json's count (a mismatch is refused)."""

    max_seq_len: int = Field(default=4096, gt=0)
    """Longest packed sequence (prompt + all turns) the learner accepts, in tokens."""

    use_dsa_indexer: bool = False
    """glm_moe_dsa only: run the DeepSeek sparse-attention indexer. Off: dense MLA (see docs/models.md)."""

    make_tiny: TinyModelConfig | None = None
    """When hf_path holds no config.json yet, `run` (local, or the Slurm job on its first node) first makes a tiny
    random model of `family` there, as ./launch.sh does for the CPU examples; an existing model is never touched.
    For the CPU examples only: a real run points hf_path at a checkpoint."""

    @model_validator(mode="after")
    def _check_make_tiny(self) -> ModelConfig:
        if self.make_tiny is None:
            return self
        if self.hf_path is None or self.family is None:
            raise ValueError("model.make_tiny needs model.hf_path (where to make it) and model.family (which one)")
        if self.num_experts is not None and self.num_experts != self.make_tiny.experts:
            raise ValueError(f"model.make_tiny.experts={self.make_tiny.experts} but model.num_experts="
                             f"{self.num_experts}: make them equal")  # fmt: skip
        return self

    @field_validator("hf_path")
    @classmethod
    def _expand(cls, v: str | None) -> str | None:
        return None if v is None else str(Path(v).expanduser())

    def hf_config_dict(self) -> dict[str, Any] | None:
        """config.json of `hf_path` with `hf_overrides` applied, or None when there is no readable file."""
        if self.hf_path is None:
            return None
        path = Path(self.hf_path) / "config.json"
        if not path.is_file():
            return None
        cfg = read_hf_config_json(path)
        cfg.update(self.hf_overrides)
        return cfg

    def resolved_num_experts(self) -> int | None:
        """Routed expert count: config.json's, checked against an explicit `num_experts`; the explicit one without
        a model directory; None when unknown."""
        cfg = self.hf_config_dict()
        found = None
        for key in ("num_experts", "n_routed_experts", "num_local_experts"):
            if cfg is not None and cfg.get(key):
                found = int(cfg[key])
                break
        if self.num_experts is not None and found is not None and found != self.num_experts:
            raise ValueError(f"model.num_experts={self.num_experts} but {self.hf_path}/config.json has {found} routed "
                             f"experts; set model.num_experts to {found} or leave it unset")  # fmt: skip
        return found if found is not None else self.num_experts
