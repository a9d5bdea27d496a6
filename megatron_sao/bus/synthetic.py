"""Synthetic valid trajectories of any length, for the bus tests and tools/bus_bench.py.

Owned here: one factory that builds a multi-turn trajectory satisfying Trajectory.validate(). Called by tests/bus
and tools/bus_bench.py; never by production code.
"""

from __future__ import annotations

import time

import numpy as np

from megatron_sao.bus.schema import SCHEMA_VERSION, Timings, Trajectory, TrajectoryHeader, Turn


def make_trajectory(
    trajectory_id: str,
    num_tokens: int = 64,
    *,
    worker_id: str = "worker-0",
    version: int = 0,
    num_turns: int = 2,
    seed: int = 0,
) -> Trajectory:
    """A `num_tokens`-token episode: a prompt of T/4 tokens, then num_turns (action, observation) pairs.

    Action tokens carry weight version `version` (the first turn `version`, later ones version + 1 when
    num_turns > 1), so oldest_version() == version.
    """
    if num_tokens < 2 * num_turns + 1:
        raise ValueError(f"num_tokens={num_tokens} is too short for {num_turns} turns; use >= {2 * num_turns + 1}")
    rng = np.random.default_rng(seed)
    prompt_len = max(1, num_tokens // 4)
    span = (num_tokens - prompt_len) // num_turns
    turns = []
    mask = np.zeros(num_tokens, dtype=np.bool_)
    versions = np.full(num_tokens, -1, dtype=np.int32)
    start = prompt_len
    for i in range(num_turns):
        end_obs = num_tokens if i == num_turns - 1 else start + span
        end_act = start + max(1, (end_obs - start) // 2)
        turns.append(Turn(action_start=start, action_end=end_act, observation_end=end_obs, reward=None))
        mask[start:end_act] = True
        versions[start:end_act] = version + min(i, 1)
        start = end_obs
    logprobs = np.where(mask, -rng.random(num_tokens, dtype=np.float32), 0.0).astype(np.float32)
    now = time.time()
    header = TrajectoryHeader(
        schema_version=SCHEMA_VERSION,
        trajectory_id=trajectory_id,
        prompt_id=f"prompt-{trajectory_id}",
        sample_index=0,
        num_tokens=num_tokens,
        prompt_len=prompt_len,
        reward=1.0,
        turns=tuple(turns),
        finish_reason="stop",
        engine_id="engine-0",
        worker_id=worker_id,
        timings=Timings(started_at=now, finished_at=now),
        metadata={"style": "cute"},
    )
    tokens = rng.integers(0, 32000, num_tokens, dtype=np.int32)
    return Trajectory(header, tokens, logprobs, mask, versions)
