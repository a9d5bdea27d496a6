"""`rollout` section: engines (SGLang servers or the embedded CPU engine), sampling, agent loop, environment."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from megatron_sao.config.base import Section


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature; the learner computes log-probs at the same temperature."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1: all)."""

    top_k: int = Field(default=-1)
    """-1 disables top-k (SGLang's convention)."""

    max_new_tokens: int = Field(default=1024, gt=0)
    """Generation cap of one turn."""


class SGLangServerConfig(Section):
    """How `python -m sglang.launch_server` is started for each engine (GPU clusters)."""

    tp: int = Field(default=1, ge=1)
    """--tp-size: tensor-parallel GPUs per engine."""

    dp: int = Field(default=1, ge=1)
    """--dp-size: data-parallel replicas inside one engine (weight updates from distributed need dp=1)."""

    ep: int = Field(default=1, ge=1)
    """--ep-size: expert-parallel size (within the tp GPUs)."""

    mem_fraction_static: float = Field(default=0.85, gt=0.0, lt=1.0)
    """--mem-fraction-static: GPU memory for weights + KV cache."""

    skip_tokenizer_init: bool = False
    """--skip-tokenizer-init: the server loads no tokenizer and answers output_ids only (we never need its text)."""

    weight_version: str = "0"
    """--weight-version: the version string of the launch weights (the learner pushes str(step) after that)."""

    nnodes: int = Field(default=1, ge=1)
    """--nnodes: nodes one engine spans (SGLang's multi-node serving: its tp x dp GPUs split evenly over them, e.g.
    TP=16 over two 8-GPU nodes for a 750B model on H100s). The launcher starts it on each node with --node-rank and
    --dist-init-addr (node-rank 0's address, port dist_init_port + engine index); only node-rank 0 serves HTTP, and
    every rank of it joins the weight-update groups (its /server_info tp_size counts them all)."""

    dist_init_port: int = Field(default=31000, ge=1024, le=65535)
    """Engine i spanning nodes rendezvouses at node-rank 0's dist_init_port + i (--dist-init-addr)."""

    @property
    def gpus(self) -> int:
        """GPUs one engine takes (tp x dp); engines on one node get --base-gpu-id 0, gpus, 2 x gpus, ...
        (launch.gpus_per_node bounds how many fit)."""
        return self.tp * self.dp

    @property
    def gpus_per_node(self) -> int:
        """GPUs one engine takes on each of its nodes."""
        return self.gpus // self.nnodes

    @model_validator(mode="after")
    def _check_nodes(self) -> SGLangServerConfig:
        if self.gpus % self.nnodes:
            raise ValueError(f"rollout.sglang.nnodes={self.nnodes} does not divide the engine's tp x dp = {self.gpus} "
                             "GPUs: an engine spans its nodes evenly")  # fmt: skip
        return self

    extra_args: list[str] = Field(default_factory=list)
    """Appended verbatim to the launch command. `--quantization fp8` only with rollout.model_path set to a block-FP8
    checkpoint (SGLang then serves that checkpoint's format and pushes are quantized into it); on a bf16 checkpoint
    SGLang would quantize as it loads, and no release re-quantizes what a push brings."""


class EmbeddedEngineConfig(Section):
    """The CPU engine (`python -m megatron_sao engine`) used when rollout.engine = embedded."""

    max_running_requests: int = Field(default=32, ge=1)
    """KV slots: requests decoded together in one batch."""

    threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads per engine process (None: torch's default)."""

    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The embedded engine's compute dtype (auto: float32 on the CPU, the checkpoint's otherwise)."""

    context_length: int | None = Field(default=None, gt=0)
    """Longest sequence per request; None uses the model's max_position_embeddings."""

    tp: int = Field(default=1, ge=1)
    """--tp-size: processes one engine runs on, its model split over them by transformers' tensor-parallel plan
    (gloo), as an SGLang engine over tp GPUs; each joins the weight-update groups (docs/rollout.md)."""

    nnodes: int = Field(default=1, ge=1)
    """--nnodes: nodes one engine spans (tp / nnodes processes on each), placed by the Slurm launcher like
    rollout.sglang.nnodes; node-rank 0 serves HTTP."""

    dist_init_port: int = Field(default=31000, ge=1024, le=65535)
    """Engine i spanning nodes: its ranks meet at node-rank 0's dist_init_port + i (--dist-init-addr)."""

    @model_validator(mode="after")
    def _check_nodes(self) -> EmbeddedEngineConfig:
        if self.tp % self.nnodes:
            raise ValueError(f"rollout.embedded.nnodes={self.nnodes} does not divide rollout.embedded.tp={self.tp}: an "
                             "engine spans its nodes evenly")  # fmt: skip
        return self


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

    api_key: bool = True
    """Engines answer only to their run: the launchers make an owner-only key file, <launch.run_dir>/engine_api_key,
    start every engine (SGLang's --api-key) and push agent with it, and every process of the run sends it
    (engines/auth.py; docs/rollout.md "Engines answer only to their run"). For engines you run yourself
    (rollout.engine_urls), export SAO_ENGINE_API_KEY_FILE=<their key file> and it is sent to them."""

    num_engines: int = Field(default=1, ge=1)
    """Engines the run starts (each its own server; the rollout workers spread requests over them)."""

    base_port: int = Field(default=30000, ge=1024, le=65535)
    """Engine i listens on base_port + i."""

    host: str = "127.0.0.1"
    """Address engines bind to."""

    engine_urls: list[str] = Field(default_factory=list)
    """Already running engines (http://host:port); when set, nothing is launched."""

    router_url: str | None = None
    """A gateway in front of the engines that speaks SGLang's /generate (sglang-router, http://host:port): the rollout
    workers send every generation there and the gateway picks the engine. Weight pushes, health and version checks
    still go to each engine (engine_urls or the launched ones). The gateway does not know weight versions, so an
    engine behind on weights is not left out as the workers' own picking does (docs/rollout.md "Behind a gateway");
    when the gateway is unreachable a worker falls back to picking engines itself for that request."""

    model_path: str | None = None
    """The checkpoint the engines serve (None: model.hf_path). A block-FP8 checkpoint (config.json
    quantization_config fp8 with weight_block_size, `*_scale_inv` tensors) halves the engines' weight memory: the
    learner reads its format and quantizes every push into it (docs/weight_sync.md, "FP8 engines")."""

    sglang: SGLangServerConfig = Field(default_factory=SGLangServerConfig)
    embedded: EmbeddedEngineConfig = Field(default_factory=EmbeddedEngineConfig)

    @property
    def engine_nnodes(self) -> tuple[int, str]:
        """(nodes one engine spans, the field that says so) for the engine kind in use."""
        if self.engine == "sglang":
            return self.sglang.nnodes, "rollout.sglang.nnodes"
        return self.embedded.nnodes, "rollout.embedded.nnodes"

    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    concurrency: int = Field(default=32, ge=1)
    """In-flight episodes per rollout worker."""

    max_turns: int = Field(default=4, ge=1)
    """Most generate calls of one episode (multi-turn tool use); the episode ends there."""

    return_routed_experts: bool = False
    """Ask the engines for each token's MoE routing (SGLang's return_routed_experts; the engines are started with
    --enable-return-routed-experts) and send it with the trajectory: the learner then logs routing/mismatch_frac,
    how often its own router disagrees with the engine's. On whenever learner.routing_replay is."""
    max_total_tokens: int = Field(default=4096, gt=0)
    """Episode token limit (prompt + all turns); must not exceed model.max_seq_len."""

    request_timeout_s: float = Field(default=600.0, gt=0.0)
    """One /generate call; past it the request is aborted and re-issued on another engine."""

    max_retries: int = Field(default=3, ge=0)
    """HTTP retries (exponential back-off) of a call that could not reach its engine."""

    max_episode_attempts: int = Field(default=3, ge=1)
    """Times an episode is started from scratch when no engine could finish it (then it is counted as failed)."""

    episode_retry_backoff_s: float = Field(default=1.0, ge=0.0)
    """Wait before an episode an engine failed is started again: this times its attempt number (a wait for a healthy
    engine while none is up: this, at most 5 s, without using up an attempt)."""

    batch_gate_poll_s: float = Field(default=0.1, gt=0.0)
    """Group arms: how often a batch waiting for new weights asks the engines their weight version."""

    health_timeout_s: float = Field(default=900.0, gt=0.0)
    """Launched engines must answer /health within this time."""

    log_interval_s: float = Field(default=30.0, gt=0.0)
    """Period of the worker's throughput / engine-health log line (and of saving the prompt cursor)."""

    cursor_state: str | None = None
    """File keeping the prompt cursor across restarts; None: <launch.run_dir>/rollout_cursor.json (worker rollout-0;
    rollout_cursor_<worker_id>.json for the others)."""

    @model_validator(mode="after")
    def _check_engine_weights(self) -> RolloutConfig:
        online = [a for a in self.sglang.extra_args if a == "--quantization" or a.startswith("--quantization=")]
        if online and self.engine == "sglang" and self.model_path is None:
            raise ValueError(
                "rollout.sglang.extra_args has --quantization but rollout.model_path is not set: SGLang would quantize "
                "the bf16 checkpoint as it loads, and no SGLang release re-quantizes the weights a push brings (they "
                "would land unscaled in its fp8 parameters, and the norm-row check would not notice). Set "
                "rollout.model_path to a block-FP8 checkpoint of the model (its -FP8 release, or `python -m "
                "megatron_sao.models.fp8 SRC DST`): the learner then quantizes every push into its format"
            )
        if self.router_url is not None and not self.router_url.startswith("http://"):
            raise ValueError(f"rollout.router_url={self.router_url!r} must be an http://host:port URL of the "
                             "gateway (sglang-router's --host/--port), or unset")  # fmt: skip
        return self
