"""The weight-update process group: one trainer rank (rank 0) plus engine ranks, beside the learner's own world.

Shared by the two ends of a weight push: the learner's stage sources (weight_sync/) host it, the embedded engine
(engines/embedded/weights.py) joins it. Built the way SGLang's engines build theirs for `/init_weights_update_group`
(the TCP store of a tcp:// rendezvous, hosted by rank 0 and namespaced by the group name, then a backend group over
it), so the trainer side meets a real SGLang server and the embedded CPU engine alike; a process can hold several
such groups next to its default group. torch has no public call for a second, independent group; this uses the
same internals SGLang does.
"""

from __future__ import annotations

import datetime
import inspect
import logging
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
"""The NCCL environment a learner that survives a dead engine relies on (set by distributed.init_distributed unless
the user set it): 2 is torch's CleanUpOnly, where a failed or timed-out collective aborts its communicator and
raises in `work.wait()`. torch's default (3, SkipCleanUp) and 1 (TearDown) end the whole process from the watchdog
thread the moment any group's work fails -- an engine that dies mid-push would take the learner with it. The
weight sync aborts a broken update group itself (abort_update_group) well inside its collective timeout
(weight_sync.group_timeout_s), so the watchdog never has to; a collective of the learner's own groups that fails
still raises in the training step and ends the run with its error."""


def host_store(
    master_address: str, master_port: int, world_size: int, timeout_s: float, tries: int = 16
) -> tuple[Any, int]:
    """Rank 0: bind the group's TCP store now, on `master_port` or the next free one of `tries` ports, without waiting
    for anyone; (store, port). Binding before the engines are asked to join means a port in use fails here, at once,
    instead of leaving every engine waiting out its join timeout."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for port in range(master_port, master_port + tries):
        try:
            store = dist.TCPStore(master_address, port, world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)  # fmt: skip
        except (RuntimeError, OSError) as e:  # DistNetworkError (EADDRINUSE) is a RuntimeError
            if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
                raise
            continue
        return store, port
    raise RuntimeError(f"ports {master_port}..{master_port + tries - 1} on {master_address} are all in use")


def init_update_group(
    backend: str, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
    timeout_s: float, store: Any = None, collective_timeout_s: float | None = None,
) -> Any:  # fmt: skip
    """Join (rank 0: host, or pass the store host_store() bound) the update group; blocks until all `world_size`
    ranks joined or `timeout_s` passed. `collective_timeout_s` (default `timeout_s`): the group's collective timeout,
    which torch's NCCL watchdog enforces by ending the process."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    collective = datetime.timedelta(seconds=collective_timeout_s or timeout_s)
    # The store a tcp:// rendezvous makes, built directly: under torchrun, rendezvous() would make rank 0 a client of
    # the elastic agent's store (TORCHELASTIC_USE_AGENT_STORE), and nobody would serve this group's port.
    if store is None:
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    store = PrefixStore(group_name, store)
    # torch renamed pg_options to backend_options (2.6); pass whichever this torch takes
    params = inspect.signature(_new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=collective, **options
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def block_group_name(group_name: str, part: int) -> str:
    """The sub-group of update group `group_name` for block group `part` of a shard-aware push: its root (the stage
    source or a relay) and the engine ranks holding that part's blocks."""
    return f"{group_name}/blocks{part}"


def destroy_update_group(group: Any) -> None:
    dist.destroy_process_group(group)


def abort_update_group(group: Any) -> None:
    """Give up on a group whose peer died mid-collective: abort its communicator so pending work fails instead of
    hanging (NCCL; torch's watchdog would otherwise kill the whole process at the group's timeout), then forget it.
    Gloo has no abort: its blocked worker thread ends at the group's timeout; the group is dropped either way."""
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    try:
        if abort is not None and dist.get_backend(group) == "nccl":
            abort(group)
            return
        dist.destroy_process_group(group)
    except Exception as e:  # a broken group may refuse to be torn down; it is dropped either way
        log.warning("dropping a broken update group: %r", e)
