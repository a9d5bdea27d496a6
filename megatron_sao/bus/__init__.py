"""The trajectory bus: rollout workers -> learner over ZeroMQ, exactly-once as seen by training.

Modules, by responsibility (docs/bus.md describes the wire format and the protocol):
    schema.py       what a trajectory is (msgspec header + numpy arrays), SCHEMA_VERSION, validation
    codec.py        Trajectory <-> frames (header frame + one zero-copy frame per array), size checks
    protocol.py     the control envelope: Hello/Ping/Data/Bye and Welcome/Pong/Ack/Commit/Reject
    sender.py       TrajectorySender: producers' API (back-pressure, spool, flush)
    sender_io.py    the producer's I/O thread: session, credits, acks, resends
    spool.py        producer-side on-disk store of uncommitted trajectories
    receiver.py     TrajectoryReceiver: the learner's API (recv, commit, state_dict)
    receiver_io.py  the learner's I/O thread: limits, checks, queueing, acks
    credits.py      receiver-wide credit pool and per-connection sessions
    dedup.py        bounded exactly-once state (per-stream watermarks + recent ids), saved with checkpoints
    staleness.py    staleness gate, histogram and record of over-stale trajectories
    auth.py         CurveZMQ key files and the ZAP authenticator
    metrics.py      thread-safe counters
"""

from megatron_sao.bus.codec import FrameError
from megatron_sao.bus.receiver import TrajectoryReceiver
from megatron_sao.bus.schema import ARRAY_DTYPES, SCHEMA_VERSION, Timings, Trajectory, TrajectoryHeader, Turn
from megatron_sao.bus.sender import TrajectorySender

__all__ = [
    "ARRAY_DTYPES",
    "SCHEMA_VERSION",
    "FrameError",
    "Timings",
    "Trajectory",
    "TrajectoryHeader",
    "TrajectoryReceiver",
    "TrajectorySender",
    "Turn",
]
