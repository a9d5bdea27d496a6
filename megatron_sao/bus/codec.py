"""Trajectory <-> frames: one msgpack header frame, then one raw little-endian frame per per-token array, then the
routes frame when the header says the trajectory carries routes (schema.Routes).

Owned here: the payload layout of a data message (after the protocol envelope) and every check made on it
before a byte of it is interpreted. Called by sender.py (encode) and receiver_io.py (decode). Zero-copy both ways:
encode returns the arrays' own buffers (zmq sends them with copy=False); decode wraps the received zmq frames
with np.frombuffer, so the returned arrays are views on the received message (read-only by contract).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np

from megatron_sao.bus.protocol import Reason
from megatron_sao.bus.schema import ARRAY_DTYPES, SCHEMA_VERSION, Trajectory, TrajectoryHeader

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("the bus wire format is little-endian and sends arrays as they lie in memory")

NUM_ARRAY_FRAMES = 1 + len(ARRAY_DTYPES)
"""Header frame + one frame per per-token array (the envelope frame in front is not counted)."""
NUM_PAYLOAD_FRAMES = NUM_ARRAY_FRAMES + 1
"""The most payload frames a data message has: those, plus the routes frame."""

_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(TrajectoryHeader)


class _VersionPeek(msgspec.Struct):
    """Reads only schema_version, ignoring every other key, so another version is told apart from garbage."""

    schema_version: int


_PEEK_DECODER = msgspec.msgpack.Decoder(_VersionPeek)


class FrameError(ValueError):
    """A payload the receiver refuses; `reason` names the rejected_<reason> counter."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Limits:
    """Size limits checked before anything is decoded."""

    max_frame_bytes: int
    max_message_bytes: int
    max_header_bytes: int


class _Buffer(Protocol):
    """zmq.Frame, bytes or memoryview: anything with len() and a buffer."""

    def __len__(self) -> int: ...


_ARRAYS = tuple((name, dtype, dtype.itemsize) for name, dtype in ARRAY_DTYPES.items())


def encode(traj: Trajectory) -> list[bytes | memoryview]:
    """Header frame plus the arrays' own memory (C-contiguous; copied only when a caller passed a strided view)."""
    frames: list[bytes | memoryview] = [_HEADER_ENCODER.encode(traj.header)]
    for name in ARRAY_DTYPES:
        arr = np.ascontiguousarray(getattr(traj, name))
        frames.append(arr.data.cast("B"))
    if traj.routes is not None:
        frames.append(np.ascontiguousarray(traj.routes).reshape(-1).data.cast("B"))
    return frames


def check_sizes(frames: Sequence[_Buffer], limits: Limits) -> int:
    """Frame count and size limits; returns the total bytes. Raises FrameError."""
    if len(frames) not in (NUM_ARRAY_FRAMES, NUM_PAYLOAD_FRAMES):
        raise FrameError(Reason.FRAME_COUNT, f"{len(frames)} payload frames, expected {NUM_ARRAY_FRAMES} "
                         f"(+1 with routes)")  # fmt: skip
    sizes = [len(f) for f in frames]
    total = sum(sizes)
    hcap, fcap = limits.max_header_bytes, limits.max_frame_bytes
    if sizes[0] <= hcap and max(sizes) <= fcap and total <= limits.max_message_bytes:
        return total
    for i, n in enumerate(sizes):  # a limit is exceeded: name the first frame over its cap, else the total
        cap = hcap if i == 0 else fcap
        if n > cap:
            raise FrameError(Reason.FRAME_TOO_LARGE, f"frame {i} has {n} bytes > limit {cap}")
    if total > limits.max_message_bytes:
        raise FrameError(Reason.MESSAGE_TOO_LARGE, f"{total} bytes > max_message_bytes {limits.max_message_bytes}")
    return total


def decode(frames: Sequence[object], limits: Limits) -> tuple[Trajectory, int]:
    """Frames (header + arrays) -> (validated Trajectory whose arrays view the frames, payload bytes).

    Frames are zmq.Frame, bytes or memoryview (msgspec and np.frombuffer read any of them in place).
    traj.extras["oldest_version"] is set from the validation pass. Raises FrameError.
    """
    nbytes = check_sizes(frames, limits)  # type: ignore[arg-type]
    head = frames[0]
    try:
        header = _HEADER_DECODER.decode(head)  # type: ignore[call-overload]
    except msgspec.DecodeError as e:
        try:  # tell another schema version apart from garbage
            version = _PEEK_DECODER.decode(head).schema_version  # type: ignore[call-overload]
        except msgspec.DecodeError:
            raise FrameError(Reason.MALFORMED, f"header frame: {e}") from e
        if version == SCHEMA_VERSION:
            raise FrameError(Reason.MALFORMED, f"header frame: {e}") from e
        raise FrameError(Reason.SCHEMA_VERSION, f"schema_version {version}, expected {SCHEMA_VERSION}") from e
    if header.schema_version != SCHEMA_VERSION:
        raise FrameError(Reason.SCHEMA_VERSION, f"schema_version {header.schema_version}, expected {SCHEMA_VERSION}")
    n = header.num_tokens
    arrays = []
    for frame, (name, dtype, itemsize) in zip(frames[1:], _ARRAYS):
        size = len(frame)  # type: ignore[arg-type]
        if size != n * itemsize or n < 0:
            raise FrameError(Reason.ARRAY_SIZE, f"{name}: {size} bytes, header says {n} tokens")
        arr = np.frombuffer(frame, dtype)  # type: ignore[call-overload]
        arr.flags.writeable = False  # a view on the received message: copy before writing
        arrays.append(arr)
    routes = _decode_routes(header, frames[NUM_ARRAY_FRAMES:])
    traj = Trajectory(header, arrays[0], arrays[1], arrays[2], arrays[3], routes)
    validate_values(traj)
    return traj, nbytes


def _decode_routes(header: TrajectoryHeader, extra: Sequence[object]) -> np.ndarray | None:
    """The routes frame as [T - 1, layers, top_k] (a view), present exactly when header.routes is set."""
    spec = header.routes
    if spec is None:
        if extra:
            raise FrameError(Reason.ROUTES, "a routes frame but header.routes is None")
        return None
    if not extra:
        raise FrameError(Reason.ROUTES, f"header.routes {spec} but no routes frame")
    try:
        spec.check()
    except ValueError as e:
        raise FrameError(Reason.ROUTES, str(e)) from e
    frame = extra[0]
    if len(frame) != spec.nbytes(header.num_tokens):  # type: ignore[arg-type]
        raise FrameError(Reason.ROUTES, f"routes frame of {len(frame)} bytes, header says "  # type: ignore[arg-type]
                         f"{spec.shape(header.num_tokens)} x {spec.dtype}")  # fmt: skip
    arr = np.frombuffer(frame, spec.dtype).reshape(spec.shape(header.num_tokens))  # type: ignore[call-overload]
    arr.flags.writeable = False
    return arr


def validate_values(traj: Trajectory) -> None:
    """Trajectory.validate() on a decoded trajectory (whose arrays decode() built with the right dtypes and
    lengths); sets traj.extras["oldest_version"] from the same pass. Raises FrameError(INVALID)."""
    try:
        traj.extras["oldest_version"] = traj.validated_oldest_version(arrays_checked=True)
    except ValueError as e:
        raise FrameError(Reason.ROUTES if str(e).startswith("routes") else Reason.INVALID, str(e)) from e
