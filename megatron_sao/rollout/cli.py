"""`python -m megatron_sao rollout CONFIG --engines URL[,URL...] [--worker-id ID --shard I/N] [--section.key V ...]`:
one rollout worker pushing every finished trajectory onto the bus (cfg.bus.connect_address) until SIGTERM / SIGINT
or the prompts run out (called by cli.py; started by run/local.py, by launch/ as an srun step, or by hand)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading
from typing import Any

from megatron_sao.config import ConfigError, load_config
from megatron_sao.files import DiskFull
from megatron_sao.rollout.worker import Undelivered, WorkerIdInUse


class StoppableSink:
    """The bus sender as the worker's sink, except that a send blocked by back-pressure gives up once `stop` is set
    (the learner is gone or the run ends): it is counted and raises Undelivered, so its prompt is not marked done
    (the next run generates it again)."""

    def __init__(self, sender: Any, stop: threading.Event) -> None:
        self.sender, self.stop, self.dropped = sender, stop, 0

    def send(self, traj: Any) -> None:
        while True:
            try:
                self.sender.send(traj, timeout_s=1.0)
                return
            except TimeoutError:
                if self.stop.is_set():
                    self.dropped += 1
                    raise Undelivered("the run is stopping and the bus is full") from None

    def rejected(self) -> list[tuple[str, str, str]]:
        return self.sender.rejected()

    def acknowledge_lost(self, trajectory_id: str) -> None:
        self.sender.acknowledge_lost(trajectory_id)

    def volatile_ids(self) -> set[str]:
        """Sent, not yet committed and not spooled: lost if this process dies now (bus.spool_dir unset)."""
        return set() if self.sender.durable else set(self.sender.pending_ids())

    # rollout admission (bus/admission.py): the learner grants episode starts
    @property
    def admitting(self) -> bool | None:
        return self.sender.admitting  # type: ignore[no-any-return]

    def take_starts(self, k: int, floor: int) -> int:
        return self.sender.take_starts(k, floor)  # type: ignore[no-any-return]

    def end_start(self, floor: int) -> None:
        self.sender.end_start(floor)


def main(argv: list[str]) -> int:
    from megatron_sao.distributed.spawn import die_with_parent_if_asked

    die_with_parent_if_asked()  # started by a local run: end with it
    p = argparse.ArgumentParser(prog="python -m megatron_sao rollout")
    p.add_argument("config", help="the run's YAML/TOML config")
    p.add_argument("--engines", required=True, help="comma-separated engine URLs (http://HOST:PORT)")
    p.add_argument("--worker-id", default="rollout-0", help="unique per worker: the bus de-duplicates per worker")
    p.add_argument("--max-prompts", type=int, default=None, help="stop after this many prompts")
    p.add_argument("--shard", default="0/1", metavar="I/N", help="take every N-th prompt from the I-th (N workers)")
    args, overrides = p.parse_known_args(argv)
    try:
        shard = tuple(int(x) for x in args.shard.split("/"))
        assert len(shard) == 2
    except (ValueError, AssertionError):
        print(f"error: --shard {args.shard!r}: write I/N, e.g. 0/2")
        return 2
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"error: {e}")
        return 2
    logging.basicConfig(
        level=cfg.launch.log_level.upper(), format="%(asctime)s rollout %(name)s %(levelname)s %(message)s"
    )
    from megatron_sao.bus import TrajectorySender

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    urls = [u for u in args.engines.split(",") if u]
    from megatron_sao.distributed.dirlock import DirLock, DirLocked

    lock = DirLock(cfg.launch.run_dir, f"rollout-{args.worker_id}")
    try:
        lock.acquire()  # one worker of this id per run dir (its cursor and metrics live there)
        sender = TrajectorySender(cfg.bus, args.worker_id)
    except (ValueError, DirLocked) as e:  # (ValueError: its spool is held by a live worker of the same id)
        print(f"error: {e}")
        lock.release()
        return 2
    try:
        return _serve(cfg, args, sender, stop, urls, shard)
    finally:
        lock.release()


def _handshake_refusal(e: BaseException) -> BaseException | None:
    """The BusHandshakeError behind `e` (the learner's bus does not take this worker's keys), or None."""
    from megatron_sao.bus.sender_io import BusHandshakeError

    seen: BaseException | None = e
    for _ in range(16):  # (a chain is short; never follow a cycle)
        if seen is None or isinstance(seen, BusHandshakeError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _serve(cfg: Any, args: argparse.Namespace, sender: Any, stop: threading.Event, urls: list[str],
           shard: tuple[int, ...]) -> int:  # fmt: skip
    from megatron_sao.rollout.worker import worker_from_config

    try:
        sink = StoppableSink(sender, stop)
        worker = worker_from_config(cfg, sink, urls, worker_id=args.worker_id, shard=(shard[0], shard[1]))
        try:
            status = worker.run(max_prompts=args.max_prompts, stop=stop)
        except WorkerIdInUse as e:
            print(f"error: {e}")
            return 2
        except RuntimeError as e:  # the bus refused this worker's keys: a config error a restart cannot change
            refused = _handshake_refusal(e)
            if refused is None:
                raise
            print(f"error: {refused}", flush=True)
            return 2
        except DiskFull as e:  # what was written is whole; the cursor and the spool stand
            with contextlib.suppress(OSError):  # the log itself may be on the full disk
                print(f"error: {e}", flush=True)
            return 2
        logging.getLogger(__name__).info(
            "rollout worker %s done: %s; %d finished trajectories not delivered (stopped while the bus was full)",
            args.worker_id, status, sink.dropped,
        )  # fmt: skip
        if not (stop.is_set() and sender.durable):  # stopping with a spool: what is uncommitted waits in it (the
            sender.flush(timeout_s=5.0 if stop.is_set() else 60.0)  # learner commits one checkpoint late)
        worker.close()  # what the learner committed during the flush is done in the saved cursor
    finally:
        sender.close()
    return 0
