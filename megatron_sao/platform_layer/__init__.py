"""The CPU platform layer: lets the real megatron-core code paths run on a CPU-only machine with gloo.

`activate()` is called by distributed.bootstrap (and by tools that build megatron models) before any
megatron model or optimizer exists. Without CUDA it applies every patch in `PATCHES` (see `python -m megatron_sao
platform`), each of which names the megatron-core function it works around, why, and the versions it was checked on.
With CUDA and Transformer Engine it does nothing at all: GPU runs use megatron-core unpatched. With CUDA but without
TE it applies only the patches tagged NO_TE, whose failures come from TE's absence (seen on an H200).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from megatron_sao.platform_layer.registry import NO_TE, PATCHES, Patch

CHECKED_MEGATRON_VERSIONS = ("0.16.1",)
"""megatron-core releases the CPU layer was checked on (tests/platform/ on gloo)."""

logger = logging.getLogger(__name__)

if not torch.cuda.is_available():
    # Expected on the CPU path; megatron-core prints it once per module that falls back.
    for _expected in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        warnings.filterwarnings("ignore", message=_expected, category=UserWarning)
    # megatron-core internals, not actionable by users: fp32 DistributedOptimizer main params are views of the
    # model params (non-leaf tensors whose .grad it reads), TransformerConfig's own cuda_graph_scope default,
    # and torch's rename of the collectives megatron calls.
    warnings.filterwarnings(
        "ignore", message="The .grad attribute of a Tensor that is not a leaf", category=UserWarning
    )
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


class UntestedMegatronWarning(UserWarning):
    """The installed megatron-core release was not checked with the CPU platform layer."""


@dataclass(frozen=True)
class PlatformInfo:
    device: torch.device
    """cuda:<local rank> or cpu."""
    dist_backend: str
    """nccl on GPU, gloo on CPU."""
    cpu_layer_active: bool
    megatron_version: str
    applied: tuple[str, ...]
    """Names of the patches applied in this process (on GPU: the NO_TE ones where TE is absent, else none)."""


_applied: list[str] = []
_applied_no_te: list[str] = []


def transformer_engine_installed() -> bool:
    """Transformer Engine that megatron-core can use (the models' builder decides the same way): installed is not
    enough, a build that does not load against this torch leaves megatron on its local fallbacks."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.models.gpt import gpt_layer_specs
    except Exception as e:  # ImportError, or a TE build that fails to load (OSError, RuntimeError)
        logger.debug("Transformer Engine not usable here: %r", e)
        return False
    return bool(getattr(gpt_layer_specs, "HAVE_TE", False))


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def cpu_layer_active() -> bool:
    return bool(_applied)


def activate(local_rank: int = 0) -> PlatformInfo:
    """Pick the device and backend; on a CPU-only machine install the CPU layer (idempotent)."""
    version = megatron_version()
    if torch.cuda.is_available() and not _applied:
        # modulo: a Slurm task may see only its own GPU (CUDA_VISIBLE_DEVICES) while SLURM_LOCALID > 0
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        if not _applied_no_te and not transformer_engine_installed():
            from megatron_sao.platform_layer import cpu_megatron

            for patch in PATCHES:
                if NO_TE in patch.tags:
                    patch.apply()
                    _applied_no_te.append(patch.name)
            logger.debug("no Transformer Engine on this GPU machine: applied %s", ", ".join(_applied_no_te))
        return PlatformInfo(device, "nccl", False, version, tuple(_applied_no_te))
    if not _applied:
        if version not in CHECKED_MEGATRON_VERSIONS:
            warnings.warn(
                f"megatron-core {version} was not checked with megatron_sao's CPU platform layer (checked: "
                f"{', '.join(CHECKED_MEGATRON_VERSIONS)}); run tests/platform to see whether every patch still "
                f"applies, or install megatron-core=={CHECKED_MEGATRON_VERSIONS[-1]}",
                UntestedMegatronWarning,
                stacklevel=2,
            )
        # Importing the modules registers their patches in order.
        from megatron_sao.platform_layer import cpu_megatron, cpu_torch  # noqa: F401

        for patch in PATCHES:
            patch.apply()
            _applied.append(patch.name)
        logger.debug("CPU platform layer active: %s", ", ".join(_applied))
    return PlatformInfo(torch.device("cpu"), "gloo", True, version, tuple(_applied))


def describe_patches() -> list[Patch]:
    """Every patch of the CPU layer (importing them registers them; nothing is applied)."""
    from megatron_sao.platform_layer import cpu_megatron, cpu_torch  # noqa: F401

    return list(PATCHES)


__all__ = ["CHECKED_MEGATRON_VERSIONS", "PlatformInfo", "UntestedMegatronWarning", "activate", "describe_patches"]
