#!/usr/bin/env python
"""Generate CurveZMQ key pairs for the trajectory bus (zmq.auth certificate files).

    python tools/bus_keygen.py DIR --server learner --client worker-0 --client worker-1

writes DIR/server/learner.key{,_secret} and DIR/clients/<name>.key{,_secret}, plus DIR/authorized/<name>.key (the
public keys the receiver accepts). Point the config at them:
    bus.curve_server_key:        DIR/server/learner.key_secret   (learner)
    bus.curve_client_keys_dir:   DIR/authorized                  (learner)
    bus.curve_server_public_key: DIR/server/learner.key          (each producer)
    bus.curve_client_key:        DIR/clients/<name>.key_secret   (each producer)
Secret files are written with mode 0600; copy each producer only its own secret file and the server's public key.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_sao.bus.auth import generate_keypair


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="output directory")
    p.add_argument("--server", default="learner", help="name of the receiver's key pair")
    p.add_argument("--client", action="append", default=[], help="a producer key pair name (repeatable)")
    p.add_argument("--force", action="store_true", help="overwrite existing key files")
    a = p.parse_args(argv)
    root = Path(a.dir)
    names = [("server", a.server)] + [("clients", c) for c in a.client]
    for sub, name in names:
        if (root / sub / f"{name}.key").exists() and not a.force:
            print(f"error: {root / sub / name}.key exists; pass --force to overwrite", file=sys.stderr)
            return 2
    for sub, name in names:
        public, secret = generate_keypair(root / sub, name)
        print(f"{sub[:-1] if sub == 'clients' else sub}: {public} (public), {secret} (secret)")
        if sub == "clients":
            (root / "authorized").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(public, root / "authorized" / public.name)
    print(f"authorized client keys: {root / 'authorized'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
