"""Single-turn verifiable-answer task (registered as "verifiable_answer"): one generated turn, reward 1.0 when the
`<answer>...</answer>` (or, without tags, the last whitespace-separated word) equals the reference answer after
normalization (case, surrounding punctuation, numeric formatting), else 0.0."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from megatron_sao.rollout.envs.base import Environment, Episode, StepResult, extract_tag, register


def normalize(text: str) -> str:
    t = text.strip().strip(".!?,;:\"'").lower()
    try:
        x = float(t.replace(",", ""))
    except ValueError:
        return t
    return str(int(x)) if x.is_integer() else repr(x)


@dataclass
class VerifiableEpisode(Episode):
    answer: str = ""
    given: str | None = None

    def step(self, action_text: str) -> StepResult:
        tagged = extract_tag(action_text, "answer")
        words = action_text.split()
        self.given = tagged if tagged is not None else (words[-1] if words else None)
        return StepResult(done=True)

    def reward(self) -> float:
        self.metadata["success"] = self.given is not None and normalize(self.given) == normalize(self.answer)
        return 1.0 if self.metadata["success"] else 0.0


_FACTS = [
    ("How many legs does a spider have?", "8"),
    ("What is the capital of France?", "Paris"),
    ("How many days are in a week?", "7"),
    ("What color is the clear daytime sky?", "blue"),
    ("How many sides does a triangle have?", "3"),
]


@register
class VerifiableAnswerEnv(Environment):
    name = "verifiable_answer"

    def make_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            if rng.random() < 0.5:
                q, a = rng.choice(_FACTS)
            else:
                x, y = rng.randint(2, 30), rng.randint(2, 30)
                q, a = f"What is {x} + {y}?", str(x + y)
            out.append({"id": f"va-{seed}-{i}", "question": f"{q} Reply with <answer>...</answer>.", "answer": a})
        return out

    def start(self, prompt: dict[str, Any]) -> VerifiableEpisode:
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["question"]}]
        return VerifiableEpisode(messages=messages, metadata={"env": self.name}, answer=str(prompt["answer"]))
