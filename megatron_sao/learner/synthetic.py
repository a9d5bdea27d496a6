"""Synthetic trajectories (random multi-turn episodes with observation gaps) for tests and benchmarks."""

from __future__ import annotations

import numpy as np

from megatron_sao.bus.schema import SCHEMA_VERSION, Timings, Trajectory, TrajectoryHeader, Turn


def make_trajectory(
    rng: np.random.Generator,
    index: int,
    vocab: int = 500,
    prompt_len: int = 5,
    turns: tuple[int, ...] = (6, 4),
    observation: int = 3,
    version: int = 0,
    reward: float | None = None,
    prompt_id: str | None = None,
) -> Trajectory:
    """prompt, then for each turn: `n` generated tokens, then `observation` tokens (none after the last)."""
    pieces, mask, turn_records = [rng.integers(3, vocab, prompt_len)], [np.zeros(prompt_len, bool)], []
    pos = prompt_len
    for i, n in enumerate(turns):
        obs = observation if i < len(turns) - 1 else 0
        pieces += [rng.integers(3, vocab, n), rng.integers(3, vocab, obs)]
        mask += [np.ones(n, bool), np.zeros(obs, bool)]
        turn_records.append(Turn(pos, pos + n, pos + n + obs))
        pos += n + obs
    tokens = np.concatenate(pieces).astype(np.int32)
    action = np.concatenate(mask)
    logp = np.where(action, -rng.uniform(0.5, 4.0, tokens.size), 0.0).astype(np.float32)
    versions = np.where(action, version, -1).astype(np.int32)
    header = TrajectoryHeader(
        schema_version=SCHEMA_VERSION,
        trajectory_id=f"t{index}",
        prompt_id=prompt_id or f"p{index}",
        sample_index=0,
        num_tokens=int(tokens.size),
        prompt_len=prompt_len,
        reward=float(rng.uniform(-1, 1)) if reward is None else reward,
        turns=tuple(turn_records),
        finish_reason="stop",
        engine_id="test",
        worker_id="test",
        timings=Timings(0.0, 1.0),
    )
    return Trajectory(header, tokens, logp, action, versions)


def make_batch(n: int, seed: int = 0, **kwargs) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    shapes = [(4, (6, 4)), (3, (9,)), (7, (2, 3, 5)), (2, (12,)), (5, (4, 4)), (6, (3,))]
    out = []
    for i in range(n):
        prompt_len, turns = shapes[i % len(shapes)]
        out.append(make_trajectory(rng, i, prompt_len=prompt_len, turns=turns, **kwargs))
    return out
