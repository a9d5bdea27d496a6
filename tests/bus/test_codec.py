"""Codec and schema checks: zero-copy round trip, and every refusal names its reason."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from megatron_sao.bus import codec
from megatron_sao.bus.codec import FrameError, Limits
from megatron_sao.bus.protocol import Reason
from megatron_sao.bus.schema import SCHEMA_VERSION, Trajectory, Turn
from tests.bus.helpers import traj

LIMITS = Limits(max_frame_bytes=1 << 20, max_message_bytes=4 << 20, max_header_bytes=64 << 10)


def _frames(t: Trajectory) -> list[bytes]:
    return [bytes(f) for f in codec.encode(t)]


def test_round_trip_is_exact_and_zero_copy() -> None:
    t = traj(1, 257)
    sent = codec.encode(t)
    assert np.shares_memory(np.frombuffer(sent[1], np.int32), t.tokens)  # send side: the array's own memory
    wire = _frames(t)
    got, nbytes = codec.decode(wire, LIMITS)
    assert nbytes == sum(len(f) for f in wire) and got.extras["oldest_version"] == t.oldest_version()
    assert got.header == t.header
    for name in ("tokens", "rollout_logprobs", "action_mask", "weight_versions"):
        np.testing.assert_array_equal(getattr(got, name), getattr(t, name))
        assert not getattr(got, name).flags.writeable  # views on the received frames
    assert np.shares_memory(got.tokens, np.frombuffer(wire[1], np.uint8))  # receive side: views, no copy


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda f: f[:-1], Reason.FRAME_COUNT),
        (lambda f: [*f, b"x", b"y"], Reason.FRAME_COUNT),
        (lambda f: [*f, b"x"], Reason.ROUTES),  # a routes frame the header does not announce
        (lambda f: [b"\xc1garbage", *f[1:]], Reason.MALFORMED),
        (lambda f: [f[0][:-3], *f[1:]], Reason.MALFORMED),
        (lambda f: [f[0], f[1][:-4], *f[2:]], Reason.ARRAY_SIZE),
        (lambda f: [f[0], f[1], f[2], f[3] + b"\x00", f[4]], Reason.ARRAY_SIZE),
        (lambda f: [f[0], b"\x00" * ((1 << 20) + 4), *f[2:]], Reason.FRAME_TOO_LARGE),
        (lambda f: [b"\x80" * ((64 << 10) + 1), *f[1:]], Reason.FRAME_TOO_LARGE),
    ],
)
def test_malformed_payloads_are_refused_with_their_reason(mutate, reason: Reason) -> None:
    with pytest.raises(FrameError) as e:
        codec.decode(mutate(_frames(traj(2, 64))), LIMITS)
    assert e.value.reason == reason


def test_other_schema_version_is_told_apart_from_garbage() -> None:
    t = traj(3)
    future = msgspec.msgpack.encode({**msgspec.to_builtins(t.header), "schema_version": SCHEMA_VERSION + 1, "new": 1})
    with pytest.raises(FrameError) as e:
        codec.decode([future, *_frames(t)[1:]], LIMITS)
    assert e.value.reason == Reason.SCHEMA_VERSION


def test_message_size_limit_counts_all_frames() -> None:
    t = traj(4, 4096)
    with pytest.raises(FrameError) as e:
        codec.decode(_frames(t), Limits(max_frame_bytes=1 << 20, max_message_bytes=20000, max_header_bytes=4096))
    assert e.value.reason == Reason.MESSAGE_TOO_LARGE


def _with(t: Trajectory, **arrays: np.ndarray) -> Trajectory:
    return Trajectory(
        t.header,
        arrays.get("tokens", t.tokens),
        arrays.get("rollout_logprobs", t.rollout_logprobs),
        arrays.get("action_mask", t.action_mask),
        arrays.get("weight_versions", t.weight_versions),
    )


def test_inconsistent_values_are_invalid() -> None:
    t = traj(5, 64)
    bad_tokens = t.tokens.copy()
    bad_tokens[0] = -1
    nan_lp = t.rollout_logprobs.copy()
    nan_lp[-1] = np.nan
    mask_in_obs = t.action_mask.copy()
    mask_in_obs[t.header.turns[0].action_end] = True  # first observation token
    hole = t.action_mask.copy()
    hole[t.header.turns[0].action_start] = False
    neg_version = t.weight_versions.copy()
    neg_version[t.header.turns[1].action_start] = -1
    for bad in (
        _with(t, tokens=bad_tokens),
        _with(t, rollout_logprobs=nan_lp),
        _with(t, action_mask=mask_in_obs),
        _with(t, action_mask=hole),
        _with(t, weight_versions=neg_version),
        Trajectory(msgspec.structs.replace(t.header, reward=float("inf")), *_arrays(t)),
        Trajectory(msgspec.structs.replace(t.header, trajectory_id=""), *_arrays(t)),
        Trajectory(msgspec.structs.replace(t.header, turns=(Turn(60, 70, 70),)), *_arrays(t)),
    ):
        with pytest.raises(FrameError) as e:
            codec.decode(_frames(bad), LIMITS)
        assert e.value.reason == Reason.INVALID
        with pytest.raises(ValueError):
            bad.validate()


def _arrays(t: Trajectory) -> tuple[np.ndarray, ...]:
    return t.tokens, t.rollout_logprobs, t.action_mask, t.weight_versions


def test_synthetic_trajectories_are_valid_and_report_their_oldest_version() -> None:
    for n in (5, 64, 1000):
        t = traj(n, n, version=7)
        t.validate()
        assert t.oldest_version() == 7


def test_a_reward_needs_action_tokens_to_score() -> None:
    """A reward on a turn without generated tokens (or a terminal reward on an episode without any) has no token
    to sit on; the learner could not place it, so the trajectory is refused at the bus, not mid-step."""
    t = traj(5, 64)
    first, second, *rest = t.header.turns
    no_action = t.action_mask.copy()
    no_action[second.action_start : second.action_end] = False

    def with_second(reward: float | None) -> Trajectory:
        empty = Turn(second.action_start, second.action_start, second.observation_end, reward)
        header = msgspec.structs.replace(t.header, turns=(first, empty, *rest))
        return Trajectory(header, t.tokens, t.rollout_logprobs, no_action, t.weight_versions)

    with_second(None).validate()  # the empty turn itself is fine
    with_second(0.0).validate()
    with pytest.raises(ValueError, match=r"turns\[1\] has reward 0.5 but no action tokens"):
        with_second(0.5).validate()

    nothing = np.zeros_like(t.action_mask)
    empty_turns = tuple(Turn(x.action_start, x.action_start, x.observation_end) for x in t.header.turns)
    silent = msgspec.structs.replace(t.header, turns=empty_turns, reward=0.0)
    Trajectory(silent, t.tokens, t.rollout_logprobs, nothing, t.weight_versions).validate()
    rewarded = msgspec.structs.replace(silent, reward=1.0)
    with pytest.raises(ValueError, match="reward 1.0 but no action tokens"):
        Trajectory(rewarded, t.tokens, t.rollout_logprobs, nothing, t.weight_versions).validate()
