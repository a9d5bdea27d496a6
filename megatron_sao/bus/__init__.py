"""The trajectory bus: rollout workers -> learner over ZeroMQ (schema, codec, sender, receiver)."""

from megatron_sao.bus.schema import ARRAY_DTYPES, SCHEMA_VERSION, Timings, Trajectory, TrajectoryHeader, Turn

__all__ = ["ARRAY_DTYPES", "SCHEMA_VERSION", "Timings", "Trajectory", "TrajectoryHeader", "Turn"]
