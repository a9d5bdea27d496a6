"""A stand-in learner process for the crash tests: trains on nothing, checkpoints the ids it consumed.

    python bus_receiver.py CFG_JSON CKPT_PATH STOP_PATH [CKPT_EVERY]

The "training effect" is the list of ids in CKPT_PATH, written atomically together with the receiver's state_dict()
every CKPT_EVERY trajectories (and after 1 s without any); commit() follows each write. On start it resumes from
CKPT_PATH, as a learner restarted from its last checkpoint would. Exits once STOP_PATH exists and nothing arrives.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megatron_sao.bus import TrajectoryReceiver
from megatron_sao.config.bus import BusConfig


def save(path: Path, ids: list[str], bus_state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"ids": ids, "bus": bus_state}))
    os.replace(tmp, path)


def main() -> int:
    cfg = BusConfig(**json.loads(sys.argv[1]))
    ckpt, stop = Path(sys.argv[2]), Path(sys.argv[3])
    every = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    saved = json.loads(ckpt.read_text()) if ckpt.exists() else {"ids": [], "bus": None}
    ids: list[str] = saved["ids"]
    with TrajectoryReceiver(cfg, state=saved["bus"]) as r:
        print("ready", flush=True)
        since, idle = 0, 0
        while True:
            batch = r.recv_batch(every - since, timeout_s=0.2)
            ids += [t.trajectory_id for t in batch]
            since += len(batch)
            idle = 0 if batch else idle + 1
            if since >= every or idle >= 5:  # a checkpoint (every `every`, or after 1 s idle), then the commit
                save(ckpt, ids, r.state_dict())
                r.commit()
                since, idle = 0, 0
            if not batch and stop.exists():
                save(ckpt, ids, r.state_dict())
                return 0


if __name__ == "__main__":
    raise SystemExit(main())
