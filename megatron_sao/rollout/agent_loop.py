"""Multi-turn episodes with exact token accounting (owned by rollout/; called by worker.py for every rollout).

Sequence layout: [prompt | a_0 | o_0 | a_1 | o_1 | ... | a_n]. a_i are the tokens an engine generated for turn i,
appended exactly as returned (never re-tokenized); o_i are observation tokens (tool / environment output wrapped by
the chat template). Per token: `action_mask` is True exactly on a_i; `rollout_logprobs` is the engine's log-prob of
an action token (0 elsewhere); `weight_versions` the version that generated it (-1 elsewhere). With routes
(AgentLoopConfig.routes), each turn asks the engine for the experts of the positions it forwards that no earlier turn
did (routed_experts_start_len = the rows so far), so the trajectory's routes are those of the forwards that produced
its log-probs: row p is position p's routing, T - 1 rows.
The episode ends when the environment says done (finish_reason = the last turn's stop/length), after `max_turns`
turns (turn_limit) or when the next turn or observation would exceed `max_total_tokens` (token_limit).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np

from megatron_sao.bus.schema import SCHEMA_VERSION, Routes, Timings, Trajectory, TrajectoryHeader, Turn
from megatron_sao.engines.protocol import GenerateResult
from megatron_sao.rollout.envs.base import Environment, Episode

GenerateFn = Callable[..., tuple[GenerateResult, str]]
"""(input_ids, sampling_params[, routed_experts_start_len=n]) -> (result, engine id); EngineRouter.generate fits."""


class EpisodeAborted(RuntimeError):
    """An engine aborted a turn (e.g. pause_generation(mode=abort)); the worker re-issues the prompt."""


class TokenCodec(Protocol):
    """How text and tokens meet: prompt rendering, observation tokens, decoding a turn for the environment."""

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]: ...
    def observation_ids(self, text: str, turn_closed: bool) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def ends_turn(self, token_id: int) -> bool: ...


class ChatTemplateCodec:
    """TokenCodec over an HF tokenizer with a chat template.

    An observation is the template's rendering of one `observation_role` message plus the next assistant header,
    cut right after the end-of-turn token of the preceding assistant message: for a ChatML template
    `"\\n<|im_start|>tool\\n{text}<|im_end|>\\n<|im_start|>assistant\\n"`. When the generated turn did not end with
    the end-of-turn token (max_new_tokens hit, or stopped on a stop token), that token is prepended: it belongs
    to the template, not to the policy, so it is an observation token.
    """

    def __init__(self, tokenizer: Any, observation_role: str = "tool") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template; pass a TokenCodec of your own")
        self.tok = tokenizer
        self.role = observation_role
        self.eot_id = int(tokenizer.eos_token_id)
        self.eot_text = tokenizer.convert_ids_to_tokens(self.eot_id)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self._encode(self._render(messages, add_generation_prompt=True))

    def observation_ids(self, text: str, turn_closed: bool) -> list[int]:
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        head = self._render(base, add_generation_prompt=False)
        full = self._render([*base, {"role": self.role, "content": text}], add_generation_prompt=True)
        cut = head.rfind(self.eot_text)
        if cut < 0 or not full.startswith(head[: cut + len(self.eot_text)]):
            raise ValueError(f"chat template does not close assistant turns with {self.eot_text!r}")
        ids = self._encode(full[cut + len(self.eot_text) :])
        return ids if turn_closed else [self.eot_id, *ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def ends_turn(self, token_id: int) -> bool:
        return token_id == self.eot_id


@dataclass
class AgentLoopConfig:
    max_turns: int = 4
    max_total_tokens: int = 4096
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0, "max_new_tokens": 1024})
    routes: Routes | None = None  # ask for and carry the engines' MoE routes (rollout.return_routed_experts)


@dataclass
class _Buffers:
    tokens: list[int]
    logprobs: list[float]
    mask: list[bool]
    versions: list[int]
    routes: list[np.ndarray] = field(default_factory=list)  # [n, layers, top_k] pieces: rows of positions 0, 1, ...

    @property
    def routed(self) -> int:
        return sum(len(r) for r in self.routes)

    def add_routes(self, raw: np.ndarray | None, spec: Routes, new_tokens: int, engine: str) -> None:
        """A turn's routed_experts (flat int32 of the positions from `routed` to the sequence's last but one)."""
        rows = len(self.tokens) + new_tokens - 1 - self.routed
        width = spec.num_layers * spec.top_k
        if raw is None or raw.size != rows * width:
            got = "none" if raw is None else f"{raw.size} ids"
            raise ValueError(f"engine {engine} returned {got} routed experts; expected {rows} positions x "
                             f"{spec.num_layers} layers x top_k {spec.top_k} (serving model.hf_path?)")  # fmt: skip
        if raw.size and (int(raw.min()) < 0 or int(raw.max()) >= spec.num_experts):
            raise ValueError(f"engine {engine} routed to expert {int(raw.max())} (or {int(raw.min())}), outside the "
                             f"model's {spec.num_experts} experts")  # fmt: skip
        self.routes.append(raw.astype(spec.dtype).reshape(rows, spec.num_layers, spec.top_k))

    def add(self, ids: list[int], logprobs: list[float] | None = None, versions: list[int] | None = None) -> None:
        action = logprobs is not None
        self.tokens += ids
        self.logprobs += logprobs if action else [0.0] * len(ids)
        self.mask += [action] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)


class AgentLoop:
    def __init__(self, env: Environment, codec: TokenCodec, generate: GenerateFn, cfg: AgentLoopConfig) -> None:
        self.env, self.codec, self.generate, self.cfg = env, codec, generate, cfg

    def run(self, prompt: dict[str, Any], *, worker_id: str = "", sample_index: int = 0) -> Trajectory:
        started = time.time()
        episode = self.env.start(prompt)
        ids = (
            [int(t) for t in prompt["input_ids"]] if "input_ids" in prompt else self.codec.prompt_ids(episode.messages)
        )
        if len(ids) >= self.cfg.max_total_tokens:
            raise ValueError(f"prompt {prompt.get('id')} has {len(ids)} tokens >= max_total_tokens")
        buf = _Buffers(list(ids), [0.0] * len(ids), [False] * len(ids), [-1] * len(ids))
        turns, finish, engine = self._turns(episode, buf)
        episode.weight_version = max((v for v in buf.versions if v >= 0), default=0)
        header = TrajectoryHeader(
            schema_version=SCHEMA_VERSION,
            trajectory_id=uuid.uuid4().hex,
            prompt_id=str(prompt["id"]),
            sample_index=sample_index,
            num_tokens=len(buf.tokens),
            prompt_len=len(ids),
            reward=float(episode.reward()),
            turns=tuple(turns),
            finish_reason=finish,
            engine_id=engine,
            worker_id=worker_id,
            timings=Timings(started_at=started, finished_at=time.time()),
            metadata={**episode.metadata, "weight_version": episode.weight_version, "num_turns": len(turns)},
        )
        routes = None
        if self.cfg.routes is not None:
            header = msgspec.structs.replace(header, routes=self.cfg.routes)
            missing = len(buf.tokens) - 1 - buf.routed  # positions after the last forward (a trailing observation)
            routes = np.concatenate([*buf.routes, self.cfg.routes.filler(missing)])
        traj = Trajectory(
            header=header,
            tokens=np.asarray(buf.tokens, dtype=np.int32),
            rollout_logprobs=np.asarray(buf.logprobs, dtype=np.float32),
            action_mask=np.asarray(buf.mask, dtype=np.bool_),
            weight_versions=np.asarray(buf.versions, dtype=np.int32),
            routes=routes,
        )
        traj.validate()
        return traj

    def _turns(self, episode: Episode, buf: _Buffers) -> tuple[list[Turn], str, str]:
        turns: list[Turn] = []
        engine = ""
        for turn in range(self.cfg.max_turns):
            budget = self.cfg.max_total_tokens - len(buf.tokens)
            if budget <= 0:
                return turns, "token_limit", engine
            sampling = dict(self.cfg.sampling)
            sampling["max_new_tokens"] = min(int(sampling.get("max_new_tokens", budget)), budget)
            t0 = time.monotonic()
            routes = {} if self.cfg.routes is None else {"routed_experts_start_len": buf.routed}
            result, engine = self.generate(list(buf.tokens), sampling, **routes)
            gen_s = time.monotonic() - t0
            if result.aborted:
                raise EpisodeAborted(f"engine {engine} aborted the turn: {result.finish_reason}")
            if self.cfg.routes is not None:
                buf.add_routes(result.routed_experts, self.cfg.routes, len(result.output_ids), engine)
            start = len(buf.tokens)
            buf.add(result.output_ids, result.logprobs, result.versions)
            t1 = time.monotonic()
            step = episode.step(self.codec.decode(result.output_ids))
            tool_s = time.monotonic() - t1
            if step.done or step.observation is None:
                turns.append(Turn(start, len(buf.tokens), len(buf.tokens), step.reward, gen_s, tool_s))
                if result.finish_type == "length" and len(buf.tokens) >= self.cfg.max_total_tokens:
                    return turns, "token_limit", engine
                return turns, result.finish_type, engine
            closed = bool(result.output_ids) and self.codec.ends_turn(result.output_ids[-1])
            obs = self.codec.observation_ids(step.observation, closed)
            action_end = len(buf.tokens)
            last_turn = turn == self.cfg.max_turns - 1
            if last_turn or action_end + len(obs) >= self.cfg.max_total_tokens:  # no next turn to observe for
                turns.append(Turn(start, action_end, action_end, step.reward, gen_s, tool_s))
                return turns, "turn_limit" if last_turn else "token_limit", engine
            buf.add(obs)
            turns.append(Turn(start, action_end, len(buf.tokens), step.reward, gen_s, tool_s))
        return turns, "turn_limit", engine
