"""A hand-driven DEALER that speaks just enough of the bus protocol to deliver arbitrary frames (fuzz, floods)."""

from __future__ import annotations

import time

import zmq

from megatron_sao.bus import protocol


class RawClient:
    """Says Hello (with a huge demand) and tracks credits; send_raw() then pushes any frames as they are."""

    def __init__(self, addr: str, worker_id: str = "raw", *, hello: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)
        self.granted = 0
        self.sent = 0
        self.seq = 0
        if hello:
            self.sock.send(protocol.encode(protocol.Hello(protocol.PROTOCOL_VERSION, 1, worker_id, "e", 0, 10**9)))
            self.wait_credit()

    def pump(self, timeout_ms: int = 0) -> None:
        while self.sock.poll(timeout_ms):
            msg = protocol.decode_to_sender(self.sock.recv())
            if isinstance(msg, protocol.Ack | protocol.Pong | protocol.Welcome):
                self.granted = max(self.granted, msg.granted)
            timeout_ms = 0

    def wait_credit(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        self.pump()
        while self.sent >= self.granted:
            if time.monotonic() > deadline:
                raise TimeoutError("no credit from the receiver")
            self.pump(50)

    def bye(self) -> None:
        """End the session as a producer does: the receiver frees its credit at once (without it, at its peer timeout:
        the raw client never pings)."""
        self.sock.send(protocol.encode(protocol.Bye(0)))

    def data_envelope(self) -> bytes:
        self.seq += 1
        return protocol.encode(protocol.Data(self.seq, 0, 10**9))

    def send_raw(self, frames: list[bytes], *, with_credit: bool = True) -> None:
        if with_credit:
            self.wait_credit()
        self.sock.send_multipart(frames)
        self.sent += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
