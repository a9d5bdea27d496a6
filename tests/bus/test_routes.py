"""MoE routes on the bus (schema.Routes): they round-trip compactly, and every malformed routes frame is refused
with the counted reason `routes` before the learner sees it."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from megatron_sao.bus import TrajectoryReceiver, TrajectorySender, codec
from megatron_sao.bus.codec import FrameError, Limits
from megatron_sao.bus.protocol import Reason
from megatron_sao.bus.schema import Routes, Trajectory
from tests.bus.helpers import fast_cfg, free_addr, traj, wait_for

LIMITS = Limits(max_frame_bytes=1 << 22, max_message_bytes=8 << 20, max_header_bytes=64 << 10)


def routed(t: Trajectory, layers: int = 3, top_k: int = 2, experts: int = 8, seed: int = 0) -> Trajectory:
    """`t` with valid random routes: distinct experts per (position, layer)."""
    spec = Routes(num_layers=layers, top_k=top_k, num_experts=experts)
    rng = np.random.default_rng(seed)
    rows, _, _ = spec.shape(t.header.num_tokens)
    ids = np.argsort(rng.random((rows, layers, experts)), axis=-1)[..., :top_k].astype(spec.dtype)
    return dataclasses.replace(t, header=msgspec.structs.replace(t.header, routes=spec), routes=ids)


def _frames(t: Trajectory) -> list[bytes]:
    return [bytes(f) for f in codec.encode(t)]


@pytest.mark.parametrize(("experts", "dtype"), [(8, np.uint8), (256, np.uint8), (257, np.uint16), (512, np.uint16)])
def test_routes_round_trip_in_the_smallest_dtype(experts: int, dtype: type) -> None:
    t = routed(traj(1, 65), experts=experts)
    assert t.routes.dtype == dtype and t.routes.shape == (64, 3, 2)
    wire = _frames(t)
    assert len(wire) == codec.NUM_PAYLOAD_FRAMES and len(wire[-1]) == 64 * 3 * 2 * np.dtype(dtype).itemsize
    got, _ = codec.decode(wire, LIMITS)
    np.testing.assert_array_equal(got.routes, t.routes)
    assert got.header.routes == t.header.routes and not got.routes.flags.writeable


def test_a_trajectory_without_routes_has_no_routes_frame() -> None:
    wire = _frames(traj(2, 40))
    assert len(wire) == codec.NUM_ARRAY_FRAMES
    assert codec.decode(wire, LIMITS)[0].routes is None


def _refused(frames: list[bytes]) -> FrameError:
    with pytest.raises(FrameError) as e:
        codec.decode(frames, LIMITS)
    return e.value


def test_malformed_routes_are_refused_with_reason_routes() -> None:
    t = routed(traj(3, 33))
    wire = _frames(t)
    assert _refused(wire[:-1]).reason == Reason.ROUTES  # announced, missing
    assert _refused([*wire[:-1], wire[-1][:-1]]).reason == Reason.ROUTES  # one byte short
    out_of_range = t.routes.copy()
    out_of_range[5, 1, 0] = 8
    e = _refused(_frames(dataclasses.replace(t, routes=out_of_range)))
    assert e.reason == Reason.ROUTES and "num_experts 8" in e.detail and "position 5" in e.detail
    twice = t.routes.copy()
    twice[7, 2] = [3, 3]
    e = _refused(_frames(dataclasses.replace(t, routes=twice)))
    assert e.reason == Reason.ROUTES and "position 7 layer 2" in e.detail
    bad_spec = msgspec.structs.replace(t.header, routes=Routes(num_layers=3, top_k=9, num_experts=8))
    assert _refused([msgspec.msgpack.encode(bad_spec), *wire[1:]]).reason == Reason.ROUTES
    with pytest.raises(ValueError, match="routes"):
        dataclasses.replace(t, routes=twice).validate()


def test_dense_layers_rows_of_zeros_pass() -> None:
    t = routed(traj(4, 20))
    zeros = t.routes.copy()
    zeros[:, 0] = 0  # a layer without a router: SGLang leaves its rows at zero
    codec.decode(_frames(dataclasses.replace(t, routes=zeros)), LIMITS)


def test_shape_mismatch_is_named_at_send() -> None:
    t = routed(traj(5, 20))
    with pytest.raises(ValueError, match=r"routes: expected a uint8 array of shape \(19, 3, 2\)"):
        dataclasses.replace(t, routes=t.routes[:-1]).check_shapes()
    with pytest.raises(ValueError, match="header.routes is None"):
        dataclasses.replace(t, header=traj(5, 20).header).check_shapes()


def test_the_receiver_counts_routes_refusals_and_delivers_good_routes() -> None:
    cfg = fast_cfg(free_addr())
    with TrajectoryReceiver(cfg) as r, TrajectorySender(cfg, "p") as s:
        good = routed(traj(0, 50))
        bad = routed(traj(1, 50))
        bad.routes[3, 0] = [1, 1]
        s.send(bad, timeout_s=5)  # validate_on_send is off: the receiver's check counts
        s.send(good, timeout_s=5)
        got = r.recv_batch(1, timeout_s=20)
        assert [t.trajectory_id for t in got] == ["w-0"]
        np.testing.assert_array_equal(got[0].routes, good.routes)
        wait_for(lambda: s.rejected(), what="reject")
        assert s.rejected()[0][:2] == ("w-1", "routes")
        assert r.metrics()["rejected_routes"] == 1
        r.commit()
        assert s.flush(5)


@pytest.mark.parametrize("top_k", [2, 8, 17])  # pairwise comparison up to 16, sorting above
def test_a_repeated_expert_is_found_at_any_top_k(top_k: int) -> None:
    t = routed(traj(6, 30), top_k=top_k, experts=64)
    codec.decode(_frames(t), LIMITS)
    twice = t.routes.copy()
    twice[11, 1, -1] = twice[11, 1, 0]
    e = _refused(_frames(dataclasses.replace(t, routes=twice)))
    assert e.reason == Reason.ROUTES and "position 11 layer 1" in e.detail
