"""`rollout` section: engines (SGLang servers or the embedded CPU engine), sampling, agent loop, environment."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from megatron_sao.config.base import Section


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature; the learner computes log-probs at the same temperature."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1)
    """-1 disables top-k (SGLang's convention)."""

    max_new_tokens: int = Field(default=1024, gt=0)
    """Generation cap of one turn."""


class SGLangServerConfig(Section):
    """How `python -m sglang.launch_server` is started for each engine (GPU clusters)."""

    tp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    mem_fraction_static: float = Field(default=0.85, gt=0.0, lt=1.0)
    extra_args: list[str] = Field(default_factory=list)
    """Appended verbatim to the launch command."""


class EnvConfig(Section):
    name: str = "arithmetic"
    """Registered environment name (arithmetic, style_preference, verifiable_answer, or a plug-in)."""

    prompts: str | None = None
    """JSONL file of prompts; None generates them with the environment's own generator."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Environment-specific options."""


class RolloutConfig(Section):
    engine: Literal["embedded", "sglang"] = "embedded"
    """embedded: CPU engine speaking SGLang's HTTP API; sglang: real SGLang servers."""

    num_engines: int = Field(default=1, ge=1)
    base_port: int = Field(default=30000, ge=1024, le=65535)
    """Engine i listens on base_port + i."""

    host: str = "127.0.0.1"
    """Address engines bind to."""

    engine_urls: list[str] = Field(default_factory=list)
    """Already running engines (http://host:port); when set, nothing is launched."""

    sglang: SGLangServerConfig = Field(default_factory=SGLangServerConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    concurrency: int = Field(default=32, ge=1)
    """In-flight episodes per rollout worker."""

    max_turns: int = Field(default=4, ge=1)
    max_total_tokens: int = Field(default=4096, gt=0)
    """Episode token limit (prompt + all turns); must not exceed model.max_seq_len."""

    request_timeout_s: float = Field(default=600.0, gt=0.0)
    max_retries: int = Field(default=3, ge=0)
