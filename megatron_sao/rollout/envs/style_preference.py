"""Style preference with a switching target (registered as "style_preference"): online adaptation.

One-turn writing prompts. The reward prefers one style — cute, chuunibyou or classical — and the preferred style
switches on a schedule: every `period` weight versions (schedule="version", default: the step the learner is at,
read from the newest version among the trajectory's tokens), every `period` finished episodes of this
environment object (schedule="episodes"), or once the policy has learned the style to `level` (schedule="level":
the mean style score of the phase's last `window` finished episodes reaches `level`; the next style then applies
from the version after the newest this environment has seen; a phase that does not reach it ends after `period`
versions). Switching at a level leaves the next style within reach: a policy that has learned one style completely
writes no other style's words any more, and nothing can reward them. The active style and its phase (0, 1, ...) are
recorded in the trajectory metadata (`style`, `phase`).
Reward (reward="ratio", default) = hits of the active style's marker words / (1 + hits of the other styles'
markers), capped at 1. reward="graded" scores in steps of 0.25 around a neutral 0.5: +0.25 per marker of the active
style, -0.25 per marker of the others (each counted up to 2), clipped to [0, 1]; a sentence in the old style then
scores below a plain one, so after a switch the rewards still differ and every baseline has something to rank.
Whatever the reward, the metadata carry `style_score` (the ratio score under the active style: the measure of
adaptation, 0 for a plain sentence) and `next_style_score` (the same under the style the next switch brings: how
reachable it is before the switch).
`demonstrate` writes in every style alike, so a model warm-started on it (tools/warm_start.py) can be steered to
any of them by the reward, as a pre-trained LLM can: what experiments/online_adaptation.py starts from.
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
import threading
from dataclasses import dataclass
from typing import Any

from megatron_sao.rollout.envs.base import Environment, Episode, StepResult, register

STYLES = ("cute", "chuunibyou", "classical")
MARKERS = {
    "cute": ("cute", "nya", "uwu", "fluffy", "sparkle", "~"),
    "chuunibyou": ("darkness", "sealed", "fate", "power", "eye", "awaken"),
    "classical": ("thee", "thou", "hath", "doth", "verily", "ere"),
}
TOPICS = ("the sea", "a cat", "the moon", "a rainy day", "breakfast", "an old castle", "the wind", "a library")
HELDOUT_TOPICS = ("a river", "an owl", "the stars", "a snowy morning", "lunch", "a lighthouse", "the rain", "a garden")
"""Topics no training prompt names: the held-out prompts of evaluation (make_heldout_prompts)."""


REWARDS = ("ratio", "graded")
SCHEDULES = ("version", "episodes", "level")


def marker_hits(text: str) -> dict[str, int]:
    words = re.findall(r"[a-z]+|~", text.lower())
    return {s: sum(words.count(m) for m in MARKERS[s]) for s in STYLES}


def style_score(text: str, style: str) -> float:
    """The ratio score: hits of `style`'s markers / (1 + hits of the others'), capped at 1."""
    hits = marker_hits(text)
    others = sum(v for s, v in hits.items() if s != style)
    return min(1.0, hits[style] / (1.0 + others))


def graded_score(text: str, style: str) -> float:
    """0.5 + 0.25 x (markers of `style`, up to 2) - 0.25 x (markers of the other styles, up to 2), in [0, 1]."""
    hits = marker_hits(text)
    others = sum(v for s, v in hits.items() if s != style)
    return min(1.0, max(0.0, 0.5 + 0.25 * min(hits[style], 2) - 0.25 * min(others, 2)))


@dataclass
class StyleEpisode(Episode):
    env: StylePreferenceEnv | None = None
    text: str = ""

    def step(self, action_text: str) -> StepResult:
        self.text = action_text
        return StepResult(done=True)

    def reward(self) -> float:
        assert self.env is not None
        if "style" not in self.metadata:  # once per episode: a level schedule counts each score once
            phase, style, upcoming = self.env.phase_for(self)
            score = style_score(self.text, style)
            self.metadata.update(style=style, phase=phase, style_score=score,
                                 next_style_score=style_score(self.text, upcoming))  # fmt: skip
            self.env.observe(phase, score)
        style = self.metadata["style"]
        return graded_score(self.text, style) if self.env.reward_kind == "graded" else self.metadata["style_score"]


@register
class StylePreferenceEnv(Environment):
    name = "style_preference"

    def __init__(self, period: int = 50, schedule: str = "version", styles: list[str] | None = None,
                 reward: str = "ratio", level: float = 0.5, window: int = 16) -> None:  # fmt: skip
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}; use one of {', '.join(SCHEDULES)}")
        if not 0.0 < level <= 1.0 or window < 1:
            raise ValueError(f"level={level} must be in (0, 1] and window={window} >= 1")
        self.level, self.window = level, window
        self._starts = [0]  # schedule="level": the weight version each phase began at
        self._newest = 0  # the newest weight version seen
        self._scores: list[float] = []  # the current phase's last `window` style scores
        if reward not in REWARDS:
            raise ValueError(f"reward={reward!r}; use one of {', '.join(REWARDS)}")
        self.reward_kind = reward
        if period < 1:
            raise ValueError(f"period={period} must be >= 1")
        self.styles = tuple(styles or STYLES)
        unknown = set(self.styles) - set(STYLES)
        if unknown:
            raise ValueError(f"unknown styles {sorted(unknown)}; known: {STYLES}")
        self.period, self.schedule = period, schedule
        self._finished = itertools.count()
        self._lock = threading.Lock()

    def active_style(self, clock: int) -> str:
        """The preferred style at `clock` (a weight version or an episode count)."""
        return self.styles[(clock // self.period) % len(self.styles)]

    def style_for(self, episode: StyleEpisode) -> str:
        return self.phase_for(episode)[1]

    def phase_for(self, episode: StyleEpisode) -> tuple[int, str, str]:
        """(the phase, the style preferred for `episode`, the one the next switch brings)."""
        if self.schedule == "level":
            with self._lock:
                v = episode.weight_version
                self._newest = max(self._newest, v)
                while v >= self._starts[-1] + self.period:  # a phase that did not reach the level ends
                    self._starts.append(self._starts[-1] + self.period)
                    self._scores = []
                phase = bisect.bisect_right(self._starts, v) - 1
            return phase, self.styles[phase % len(self.styles)], self.styles[(phase + 1) % len(self.styles)]
        if self.schedule == "episodes":
            with self._lock:
                clock = next(self._finished)
        else:
            clock = episode.weight_version
        return clock // self.period, self.active_style(clock), self.active_style(clock + self.period)

    def observe(self, phase: int, score: float) -> None:
        """schedule="level": one finished episode's style score; the phase ends when its last `window` reach the
        level (the next one starts at the version after the newest seen, so no episode already scored changes)."""
        if self.schedule != "level":
            return
        with self._lock:
            if phase != len(self._starts) - 1:
                return  # an episode of an earlier phase, finished late
            self._scores = [*self._scores, score][-self.window :]
            if len(self._scores) == self.window and sum(self._scores) / self.window >= self.level:
                self._starts.append(self._newest + 1)
                self._scores = []

    def demonstrate(self, context: str, rng: Any, mistake_rate: float) -> str:
        """A sentence about the prompt's topic in one of this environment's styles, picked uniformly (a model that
        knows every style, as a pre-trained LLM does, and leaves the choice to the reward); with probability
        `mistake_rate` a plain sentence without markers. tools/warm_start.py imitates it."""
        found = [t for t in TOPICS if t in context.rsplit("Write one short sentence about", 1)[-1]]
        topic = found[0] if found else rng.choice(TOPICS)
        if rng.random() < mistake_rate:
            return f"{topic} is here today."
        markers = list(MARKERS[rng.choice(self.styles)])
        rng.shuffle(markers)
        return f"{topic} {' '.join(markers[: rng.randint(2, 4)])}."

    def make_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [
            {"id": f"style-{seed}-{i}", "prompt": f"Write one short sentence about {rng.choice(TOPICS)}."}
            for i in range(n)
        ]

    def make_heldout_prompts(self, n: int, seed: int) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        topics = [rng.choice(HELDOUT_TOPICS) for _ in range(n)]
        return [{"id": f"style-heldout-{seed}-{i}", "prompt": f"Write one short sentence about {t}."}
                for i, t in enumerate(topics)]  # fmt: skip

    def start(self, prompt: dict[str, Any]) -> StyleEpisode:
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        return StyleEpisode(messages=messages, metadata={"env": self.name}, env=self)
