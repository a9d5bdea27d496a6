"""Follow a chain of keys with a lookup tool, then answer with the number at its end (registered as "key_chain").

The agentic main task of the tiny example: multi-turn tool use whose episodes differ in turn count (long-tailed:
most chains are short, a few long) and in length. The prompt gives a start key; the tool answers a lookup
`<tool_call>KEY</tool_call>` with `<tool_response>NEXT</tool_response>`, where NEXT is the next key or, at the end of
the chain, a number; the episode ends with `<answer>N</answer>`. Reward 1 when N is the chain's number, else 0 (an
unknown key costs a turn: the tool answers `error: no key K`). A turn is exactly one lookup or one answer: anything
else around the tag ends the episode with reward 0 (so longer turns never pay). Every prompt record carries its own
chain, so the task needs no memorization: each turn copies one thing from the context -- the last key into a lookup,
or the number into the answer. A model learns the format from demonstrations (`demonstrate`, used by
tools/warm_start.py), and RL then fixes what the demonstrations got wrong. Option `tool_latency_s`: every lookup
takes that long, as real tools (sandboxes, search) do; the episodes' durations then follow the long tail of their
lookup counts (benchmarks/pipeline_efficiency.py uses it).

A variant where a learned value can beat a running mean (experiments/critic_matters.py): `hops: uniform` draws
chains of 1..max_hops lookups alike, `show_hops: true` ends the prompt with the chain's length (`(hops: 3)`), so the
difficulty is visible before the first token, and `mistakes_by_hops` gives the demonstrator a per-turn mistake rate
for each length (tools/warm_start.py then makes a model whose success falls with the length).

A variant where credit inside the trajectory matters (experiments/credit.py): `hops: fixed` gives every chain
max_hops lookups, and `decoys: true` answers a wrong key with a decoy chain instead of an error -- visibly different
keys (capitals) that run on to the end and yield a wrong number. Every episode then has the same length (max_hops
lookups, one answer) whatever it got wrong, so its outcome cannot correlate with its length or staleness, and the
one turn that went wrong is what decides it: a baseline of the prompt has nothing to explain, a value of the state
(turns left, on a decoy or not) everything. The metadata records the lookup that left the chain (`decoy_at`) and the
state each turn acted in (`turn_states`, comma-separated, e.g. "3c": three turns left, on the chain; what
algo.name=oracle_value reads).
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_sao.rollout.envs.base import Environment, Episode, StepResult, extract_tag, register

SYSTEM = "Follow the keys: <tool_call>KEY</tool_call> looks one up; answer the number with <answer>N</answer>."
LETTERS = "abcdefghijklmnopqrstuvwxyz"
HOP_WEIGHTS = (0.40, 0.25, 0.15, 0.10, 0.06, 0.04)
"""P(chain of 1, 2, ... 6 lookups): long-tailed, as agentic episodes are."""
_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.S)
_START = re.compile(r"Start: ([a-z]+)")
_HOPS = re.compile(r"\(hops: (\d+)\)")
_ONE_TAG = re.compile(r"<(tool_call|answer)>[^<>]*</\1>")


def _key(rng: random.Random, taken: set[str], length: int) -> str:
    while True:
        k = "".join(rng.choice(LETTERS) for _ in range(length))
        if k not in taken:
            taken.add(k)
            return k


DECOY_LETTERS = LETTERS.upper()
"""A decoy chain's keys: visibly not the prompt's."""


@dataclass
class KeyChainEpisode(Episode):
    chain: dict[str, str] = field(default_factory=dict)
    answer: int = 0
    final: int | None = None
    lookups: int = 0
    tool_latency_s: float = 0.0
    hops: int = 0  # lookups to the number (decoys: on the chain and off it alike)
    decoys: bool = False
    decoy_at: int = 0  # decoys: the lookup that left the chain (1-based; 0: still on it)
    rng: random.Random | None = None  # decoys: draws the decoy keys and the wrong number
    turns: int = 0  # actions taken (a lookup or an answer each)

    def _decoy(self) -> str:
        """The decoy's answer to this lookup: its next key, or a wrong number once the chain's length is used up."""
        assert self.rng is not None
        if self.lookups >= self.hops:
            return str(self.rng.choice([n for n in range(10, 100) if n != self.answer]))
        return "".join(self.rng.choice(DECOY_LETTERS) for _ in range(len(next(iter(self.chain)))))

    def step(self, action_text: str) -> StepResult:
        self.turns += 1
        turn = action_text.replace("<|im_end|>", "").strip()
        if _ONE_TAG.fullmatch(turn) is None:  # a turn is exactly one lookup or one answer, nothing around it
            return StepResult(done=True)
        answer = extract_tag(turn, "answer")
        if answer is not None:
            self.final = int(answer) if answer.strip().isdigit() else None
            return StepResult(done=True)
        key = extract_tag(turn, "tool_call")
        if key is None:
            return StepResult(done=True)
        self.lookups += 1
        if self.tool_latency_s:
            time.sleep(self.tool_latency_s)  # a tool that takes time, as sandboxes and searches do
        key = key.strip()
        found = self.chain.get(key) if not self.decoy_at else None
        if found is None and self.decoys:
            self.decoy_at = self.decoy_at or self.lookups
            found = self._decoy()
        return StepResult(done=False, observation=f"<tool_response>{found or f'error: no key {key}'}</tool_response>")

    def reward(self) -> float:
        self.metadata["lookups"] = self.lookups
        if self.decoys:  # the state each turn acted in: turns left, and whether a decoy was in sight
            self.metadata["decoy_at"] = self.decoy_at
            self.metadata["turn_states"] = ",".join(  # metadata values are scalars (the bus's header schema)
                f"{max(self.hops + 1 - t, 0)}{'d' if 0 < self.decoy_at <= t else 'c'}" for t in range(self.turns)
            )
        self.metadata["success"] = self.final == self.answer  # reward/success_rate in the learner's metrics
        return 1.0 if self.metadata["success"] else 0.0


@register
class KeyChainEnv(Environment):
    name = "key_chain"

    def __init__(
        self, key_length: int = 2, max_hops: int = 6, tool_latency_s: float = 0.0, hops: str = "long_tail",
        show_hops: bool = False, mistakes_by_hops: list[float] | None = None, decoys: bool = False,
    ) -> None:  # fmt: skip
        if not 1 <= max_hops <= len(HOP_WEIGHTS):
            raise ValueError(f"max_hops={max_hops} must be in 1..{len(HOP_WEIGHTS)}")
        if tool_latency_s < 0:
            raise ValueError(f"tool_latency_s={tool_latency_s} must be >= 0")
        if hops not in ("long_tail", "uniform", "fixed"):
            raise ValueError(f"rollout.env.options hops={hops!r}: use 'long_tail', 'uniform' or 'fixed'")
        if decoys and hops != "fixed":
            raise ValueError("rollout.env.options decoys: true needs hops: fixed (every episode the same length)")
        if mistakes_by_hops is not None:
            if not show_hops:
                raise ValueError("rollout.env.options mistakes_by_hops needs show_hops: true (the demonstrator reads "
                                 "the length from the prompt)")  # fmt: skip
            if len(mistakes_by_hops) != max_hops or not all(0.0 <= m <= 1.0 for m in mistakes_by_hops):
                raise ValueError(f"rollout.env.options mistakes_by_hops={mistakes_by_hops}: one rate in [0, 1] per "
                                 f"chain length 1..{max_hops}")  # fmt: skip
        self.key_length, self.max_hops, self.tool_latency_s = key_length, max_hops, tool_latency_s
        self.weights = {"long_tail": HOP_WEIGHTS[:max_hops], "uniform": (1.0,) * max_hops,
                        "fixed": (0.0,) * (max_hops - 1) + (1.0,)}[hops]  # fmt: skip
        self.show_hops, self.mistakes_by_hops, self.decoys = show_hops, mistakes_by_hops, decoys

    def make_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            hops = rng.choices(range(1, self.max_hops + 1), weights=self.weights)[0]
            taken: set[str] = set()
            keys = [_key(rng, taken, self.key_length) for _ in range(hops)]
            number = rng.randint(10, 99)
            chain = {k: (keys[j + 1] if j + 1 < hops else str(number)) for j, k in enumerate(keys)}
            out.append({"id": f"chain-{seed}-{i}", "start": keys[0], "chain": chain, "answer": number, "hops": hops})
        return out

    def demonstrate(self, context: str, rng: Any, mistake_rate: float) -> str:
        if self.mistakes_by_hops is not None:
            shown = _HOPS.search(context)
            if shown is None:
                raise ValueError("a key_chain context without its '(hops: N)' (show_hops) for mistakes_by_hops")
            mistake_rate = self.mistakes_by_hops[int(shown.group(1)) - 1]
        return demonstrate(context, rng, mistake_rate)

    def start(self, prompt: dict[str, Any]) -> KeyChainEpisode:
        user = f"Start: {prompt['start']}" + (f" (hops: {prompt['hops']})" if self.show_hops else "")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        return KeyChainEpisode(messages=messages, metadata={"env": self.name, "hops": int(prompt["hops"])},
                               chain=dict(prompt["chain"]), answer=int(prompt["answer"]),
                               tool_latency_s=self.tool_latency_s, hops=int(prompt["hops"]), decoys=self.decoys,
                               rng=random.Random(str(prompt["id"])) if self.decoys else None)  # fmt: skip


def demonstrate(context: str, rng: random.Random, mistake_rate: float) -> str:
    """The demonstrator's next turn for a key_chain context (the text so far): look up the last key, or answer the
    number once a lookup gave one. With probability `mistake_rate` a turn goes wrong (a key with one letter
    changed, or an answer with a wrong number), so imitation leaves room for RL."""
    responses = _RESPONSE.findall(context)
    last = responses[-1].strip() if responses else None
    if last is None:
        start = _START.search(context)
        last = start.group(1) if start else ""
    wrong = rng.random() < mistake_rate
    if last.isdigit():
        number = str(rng.randint(10, 99)) if wrong else last
        return f"<answer>{number}</answer>"
    if last.startswith("error"):  # a wrong lookup earlier: give up with a guess
        return f"<answer>{rng.randint(10, 99)}</answer>"
    key = last
    if wrong and key:
        i = rng.randrange(len(key))
        key = key[:i] + rng.choice(LETTERS.replace(key[i], "")) + key[i + 1 :]
    return f"<tool_call>{key}</tool_call>"
