"""`eval` section: held-out evaluation during training and of checkpoints (rollout/evaluate.py; run/learn.py
schedules it; `python -m megatron_sao eval` runs it offline)."""

from __future__ import annotations

from pydantic import Field, model_validator

from megatron_sao.config.base import Section


class EvalSamplingConfig(Section):
    """Sampling of evaluation requests: greedy at temperature 0, unlike training's."""

    temperature: float = Field(default=1.0, ge=0.0)
    """0: greedy (then one sample per prompt says all there is: eval.samples_per_prompt must be 1)."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling of evaluation requests (1: all tokens)."""

    top_k: int = -1
    """-1 disables top-k (SGLang's convention)."""

    max_new_tokens: int | None = Field(default=None, gt=0)
    """None: rollout.sampling.max_new_tokens."""


class EvalConfig(Section):
    interval: int = Field(default=0, ge=0)
    """Evaluate every this many policy versions (and the initial and the final version); 0: no evaluation during
    training. Each evaluation measures exactly one version: the next push waits until it is done (training goes on)."""

    prompts: str | None = None
    """JSONL of held-out prompts (tools/make_prompts.py's format). None: the environment makes eval.num_prompts with
    eval.seed, leaving out any the training prompts hold. Either way a prompt the training prompts hold is refused."""

    num_prompts: int = Field(default=16, ge=1)
    """Prompts of one evaluation (the first this many of eval.prompts)."""

    seed: int = 1_000_003
    """Seed of the environment's held-out prompts (training's are made with seed 0)."""

    samples_per_prompt: int = Field(default=4, ge=1)
    """k: samples per prompt; eval/pass@1, eval/pass@k and eval/avg@k are computed from them."""

    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)

    budget: float = Field(default=0.25, gt=0.0, le=1.0)
    """Share of the engines' request slots an evaluation may take: at most max(1, budget x rollout.concurrency)
    evaluation episodes in flight."""

    success_reward: float = 1.0
    """A sample counts as solved when its environment reports success, else when its reward is at least this."""

    timeout_s: float = Field(default=300.0, gt=0)
    """An evaluation not done in this long is given up (eval/given_up) and the push it holds goes out. With several
    learner ranks the others wait for it inside the push, so it must stay under their 600 s collective timeout."""

    max_restarts: int = Field(default=2, ge=0)
    """An evaluation whose samples came back from another weight version (an engine restarted, or weights pushed
    from elsewhere) starts over on the version the engines now hold, at most this many times (eval/restarts)."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.sampling.temperature == 0 and self.samples_per_prompt > 1:
            raise ValueError(f"eval.sampling.temperature=0 (greedy) with eval.samples_per_prompt="
                             f"{self.samples_per_prompt}: greedy samples are all alike; set eval.samples_per_prompt=1 "
                             "or a temperature > 0")  # fmt: skip
        return self
