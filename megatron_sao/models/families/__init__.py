"""Registry of the supported model families (one module each)."""

from __future__ import annotations

from megatron_sao.models.families import glm4_moe, glm_moe_dsa, llama, qwen3, qwen3_moe
from megatron_sao.models.families.base import HFConfig, ModelFamily, UnsupportedModelError

FAMILIES: dict[str, ModelFamily] = {
    f.name: f for f in (qwen3_moe.FAMILY, glm4_moe.FAMILY, glm_moe_dsa.FAMILY, qwen3.FAMILY, llama.FAMILY)
}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise UnsupportedModelError(f"unknown model family {name!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name]


def detect_family(hf: HFConfig, explicit: str | None = None) -> ModelFamily:
    """The family of an HF config (its model_type), checked against `explicit` when given."""
    model_type = hf.get("model_type")
    matches = [f for f in FAMILIES.values() if model_type in f.hf_model_types]
    if explicit is not None:
        family = get_family(explicit)
        if model_type is not None and family not in matches:
            raise UnsupportedModelError(
                f"model.family={explicit} but config.json says model_type={model_type!r}; fix one of them"
            )
        return family
    if not matches:
        supported = ", ".join(sorted(t for f in FAMILIES.values() for t in f.hf_model_types))
        raise UnsupportedModelError(
            f"unsupported architecture: model_type={model_type!r} (architectures={hf.get('architectures')}); "
            f"supported model types: {supported}"
        )
    return matches[0]


__all__ = ["FAMILIES", "HFConfig", "ModelFamily", "UnsupportedModelError", "detect_family", "get_family"]
