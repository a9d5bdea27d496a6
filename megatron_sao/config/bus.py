"""`bus` section: the ZeroMQ trajectory bus between rollout workers and the learner."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from megatron_sao.config.base import Section


class BusConfig(Section):
    bind: str = "tcp://127.0.0.1:5555"
    """Address the learner's receiver binds (explicit interface; never 0.0.0.0 by default)."""

    connect: str | None = None
    """Address producers connect to; None uses `bind`."""

    max_inflight: int = Field(default=64, ge=1)
    """Credits: unacknowledged trajectories a producer may have outstanding (back-pressure)."""

    max_message_bytes: int = Field(default=1 << 30, gt=0)
    """Largest accepted trajectory message, all frames together."""

    max_frame_bytes: int = Field(default=512 << 20, gt=0)
    """Largest accepted single frame."""

    spool_dir: str | None = None
    """Producer-side directory keeping unacknowledged trajectories across producer restarts."""

    resend_after_s: float = Field(default=10.0, gt=0.0)
    """Resend a trajectory that has not been acknowledged within this time."""

    max_staleness: int | None = Field(default=None, ge=0)
    """Largest allowed gap, in weight versions, between the learner and a trajectory's oldest token."""

    stale_policy: Literal["drop", "keep"] = "drop"
    """What to do with trajectories over max_staleness (both are counted and recorded by id)."""

    curve_server_key: str | None = None
    """CurveZMQ: the server's secret key file; set with curve_client_keys_dir to require authentication."""

    curve_client_keys_dir: str | None = None
    """CurveZMQ: directory of authorized client public keys."""
