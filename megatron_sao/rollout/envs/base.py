"""The environment plug-in interface and registry (owned by envs/; the agent loop drives episodes, the worker and
tools/make_prompts.py look environments up by name).

An environment is a class with a `name`, built from `rollout.env.options` as keyword arguments:

    class MyEnv(Environment):
        name = "my_env"
        def make_prompts(self, n, seed) -> list[dict]: ...      # JSONL records: {"id", "messages" | "prompt", ...}
        def start(self, prompt: dict) -> Episode: ...           # one Episode per rollout

    class MyEpisode(Episode):
        def step(self, action_text: str) -> StepResult: ...     # after each generated turn: observation or done
        def reward(self) -> float: ...                          # terminal reward, when the episode has ended

Register it with `@register` (built-ins), or name it by import path in the config: `rollout.env.name: "pkg.mod:MyEnv"`.
Episodes see decoded text only for parsing; the agent loop owns every token (see agent_loop.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_sao.bus.schema import MetadataValue


@dataclass(frozen=True)
class StepResult:
    """What the environment answers after a generated turn."""

    done: bool
    observation: str | None = None  # text appended as the next (non-action) message when not done
    reward: float | None = None  # optional per-turn reward (recorded on the Turn)


@dataclass
class Episode(ABC):
    """One rollout's environment state. `messages` is the chat the first turn is generated from."""

    messages: list[dict[str, str]]
    metadata: dict[str, MetadataValue] = field(default_factory=dict)  # copied into the trajectory header; "success"
    # (bool) and "reward/<name>" (numbers) become reward/success_rate and reward/<name> in the learner's metrics
    weight_version: int = 0  # newest weight version among the generated tokens; set by the agent loop before reward()

    @abstractmethod
    def step(self, action_text: str) -> StepResult: ...

    @abstractmethod
    def reward(self) -> float: ...


class Environment(ABC):
    name: ClassVar[str]

    def __init__(self, **options: Any) -> None:
        if options:
            raise ValueError(f"environment {self.name!r} takes no options {sorted(options)}")

    @abstractmethod
    def make_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """n prompt records for a JSONL file (each with a unique "id")."""

    def make_heldout_prompts(self, n: int, seed: int) -> list[dict[str, Any]]:
        """n prompt records for evaluation (rollout/evaluate.py), none of which training draws: by default
        make_prompts with another seed (the evaluator drops any the training prompts hold); an environment whose
        prompts come from a small pool overrides it with a pool of its own."""
        return self.make_prompts(n, seed)

    @abstractmethod
    def start(self, prompt: dict[str, Any]) -> Episode:
        """A fresh episode for one prompt record."""

    def demonstrate(self, context: str, rng: Any, mistake_rate: float) -> str:
        """A demonstrator's next turn given the episode's text so far (tools/warm_start.py imitates it); optional."""
        raise NotImplementedError(f"environment {self.name!r} has no demonstrator; tools/warm_start.py needs one")


REGISTRY: dict[str, type[Environment]] = {}


def register(cls: type[Environment]) -> type[Environment]:
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"environment name {cls.name!r} is already registered by {REGISTRY[cls.name]}")
    REGISTRY[cls.name] = cls
    return cls


def extract_tag(text: str, tag: str) -> str | None:
    """Content of the last <tag>...</tag> in text, stripped (None when absent)."""
    start = text.rfind(f"<{tag}>")
    if start < 0:
        return None
    end = text.find(f"</{tag}>", start)
    if end < 0:
        return None
    return text[start + len(tag) + 2 : end].strip()
