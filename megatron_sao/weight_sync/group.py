"""The weight-update process group: trainer rank 0 plus every engine rank, beside the learner's own world.

Built the way SGLang's engines build theirs for `/init_weights_update_group` (the TCP store of a tcp://
rendezvous, hosted by rank 0 and namespaced by the group name, then a backend group over it), so the trainer side
here meets a real SGLang server and the embedded CPU engine alike; a process can hold it next to its default group
(the learner's world). torch has no public call for a second, independent group; this uses the same internals
SGLang does.
"""

from __future__ import annotations

import datetime
import inspect
from typing import Any

import torch.distributed as dist


def init_update_group(
    backend: str, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
    timeout_s: float,
) -> Any:  # fmt: skip
    """Join (rank 0: host) the update group; blocks until all `world_size` ranks joined or `timeout_s` passed."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    # The store a tcp:// rendezvous makes, built directly: under torchrun, rendezvous() would make rank 0 a client
    # of the elastic agent's store (TORCHELASTIC_USE_AGENT_STORE), and nobody would serve this group's port.
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = PrefixStore(group_name, store)
    # torch renamed pg_options to backend_options (2.6); pass whichever this torch takes
    params = inspect.signature(_new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **options
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_update_group(group: Any) -> None:
    dist.destroy_process_group(group)
