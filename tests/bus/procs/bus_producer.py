"""A stand-in rollout worker for the crash tests: sends COUNT trajectories with deterministic ids.

    python bus_producer.py CFG_JSON WORKER_ID COUNT PROGRESS_PATH [TOKENS] [SLEEP_S]

PROGRESS_PATH holds how many trajectories send() has accepted; a restarted producer resumes from it (the one it was
sending when killed may go out twice: the sender's spool and the receiver's de-dup make that harmless). Exits 0
once everything is committed by the learner, 3 if that did not happen in time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from megatron_sao.bus import TrajectorySender
from megatron_sao.bus.synthetic import make_trajectory
from megatron_sao.config.bus import BusConfig


def main() -> int:
    cfg = BusConfig(**json.loads(sys.argv[1]))
    worker, count, progress = sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    sleep_s = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    start = int(progress.read_text()) if progress.exists() else 0
    sender = TrajectorySender(cfg, worker)
    print("ready", flush=True)
    for k in range(start, count):
        sender.send(make_trajectory(f"{worker}-{k}", tokens, worker_id=worker, seed=k), timeout_s=60)
        tmp = progress.with_suffix(".tmp")
        tmp.write_text(str(k + 1))
        os.replace(tmp, progress)
        if sleep_s:
            time.sleep(sleep_s)
    ok = sender.flush(timeout_s=60)
    sender.close()
    return 0 if ok else 3


if __name__ == "__main__":
    raise SystemExit(main())
