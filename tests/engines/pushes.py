"""A hand-rolled trainer side of SGLang's weight push for the engine tests (the learner's own is weight_sync/): join
an update group, and push named tensors to engines inside a session, per tensor or as one flattened bucket."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from megatron_sao.distributed import flat_bucket
from megatron_sao.distributed.update_group import host_store, init_update_group
from megatron_sao.engines.client import SGLangClient


def in_thread(box: dict[str, Any], key: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> threading.Thread:
    """Run fn in a thread; its result (or the exception it raised) lands in box[key]."""

    def target() -> None:
        try:
            box[key] = fn(*args, **kwargs)
        except Exception as e:
            box[key] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def join_group(clients: list[SGLangClient], port: int, name: str = "g", timeout_s: float = 120.0) -> Any:
    """Form update group `name`: the engines as ranks 1.., this process as rank 0."""
    box: dict[str, Any] = {}
    world = 1 + len(clients)
    store, port = host_store("127.0.0.1", port, world, timeout_s)  # bound before the engines dial it
    threads = [in_thread(box, c.url, c.init_weights_update_group, "127.0.0.1", port, i + 1, world, name, "gloo")
               for i, c in enumerate(clients)]  # fmt: skip
    group = init_update_group("gloo", "127.0.0.1", port, world, 0, name, timeout_s, store=store)
    for t in threads:
        t.join(timeout_s)
    for c in clients:
        assert box[c.url]["success"], box[c.url]
    return group


def update(
    clients: list[SGLangClient],
    tensors: Mapping[str, torch.Tensor],
    group: Any,
    *,
    group_name: str = "g",
    version: int | None = None,
    flattened: bool = False,
    declared_shapes: Mapping[str, list[int]] | None = None,
    send: bool = True,
    send_declared: bool = True,
    declared_dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, Any]:
    """One /update_weights_from_distributed to every engine while this rank broadcasts the tensors (declared with
    `declared_shapes` and `declared_dtypes` where given: a wrong declaration the engine must drain and refuse; zeros of
    the declared shapes are sent, or with `send_declared=False` the tensors as they are). `send=False`: announce only
    (for requests the engine refuses before receiving). Returns {url: answer or exception}."""
    names = list(tensors)
    if flattened:
        names = flat_bucket.aligned_order(names, lambda n: tensors[n].dtype)
    shapes = [list((declared_shapes or {}).get(n, list(tensors[n].shape))) for n in names]
    dtypes = [flat_bucket.dtype_name((declared_dtypes or {}).get(n, tensors[n].dtype)) for n in names]
    box: dict[str, Any] = {}
    threads = [in_thread(box, c.url, c.update_weights_from_distributed, names, dtypes, shapes, group_name=group_name,
                         weight_version=version, flush_cache=False,
                         load_format="flattened_bucket" if flattened else None) for c in clients]  # fmt: skip
    if send:
        outgoing = [torch.zeros(s, dtype=tensors[n].dtype) if send_declared and list(tensors[n].shape) != s
                    else tensors[n].contiguous() for n, s in zip(names, shapes)]  # fmt: skip
        if flattened:
            slots = flat_bucket.layout(names, [t.dtype for t in outgoing], [list(t.shape) for t in outgoing])
            buffer = torch.empty(flat_bucket.nbytes(slots), dtype=torch.uint8)
            for slot, t in zip(slots, outgoing):
                flat_bucket.view(buffer, slot).copy_(t)
            outgoing = [buffer]
        for t in outgoing:
            torch.distributed.broadcast(t, src=0, group=group)
    for t in threads:
        t.join(120)
    return box


def session_push(
    clients: list[SGLangClient], tensors: Mapping[str, torch.Tensor], version: int, group: Any, **kwargs: Any
) -> dict[str, Any]:
    """begin -> one update carrying `version` -> end on every engine; {url: {"update": ..., "end": ...}}."""
    for c in clients:
        c.begin_weight_update()
    answers = update(clients, tensors, group, version=version, **kwargs)
    out: dict[str, Any] = {}
    for c in clients:
        try:
            end: Any = c.end_weight_update()
        except Exception as e:
            end = e
        out[c.url] = {"update": answers.get(c.url), "end": end}
    return out


def sharded_update(
    clients: list[SGLangClient],
    tensors: Mapping[str, torch.Tensor],
    blocks: list[Any],
    *,
    group_name: str,
    version: int | None = None,
) -> tuple[dict[str, Any], list[int], list[dict[str, str]]]:
    """One /update_weights_from_distributed with load_format="sharded_bucket" to engines of one TP size, joined with
    block groups [[rank r of every engine] for each r] (`blocks`: those sub-groups): block group r is sent, in one
    broadcast, only the blocks rank r holds of every tensor /weight_shards lists. ({url: answer or exception}, bytes
    sent to rank r, rank r's checksums of what it was sent)."""
    table = clients[0].weight_shards()
    names = flat_bucket.aligned_order(list(tensors), lambda n: tensors[n].dtype)
    slots = flat_bucket.layout(names, [tensors[n].dtype for n in names], [list(tensors[n].shape) for n in names])
    full = torch.empty(flat_bucket.nbytes(slots), dtype=torch.uint8)
    for slot in slots:
        flat_bucket.view(full, slot).copy_(tensors[slot.name])
    per_rank = []
    for r in range(table["tp_size"]):
        boxes = {n: b[r] for n, b in table["shards"].items() if b[r] is not None}
        per_rank.append(flat_bucket.sharded(slots, full, boxes))
    box: dict[str, Any] = {}
    threads = [in_thread(box, c.url, c.update_weights_from_distributed, names,
                         [flat_bucket.dtype_name(tensors[n].dtype) for n in names],
                         [list(tensors[n].shape) for n in names], group_name=group_name, weight_version=version,
                         flush_cache=False, load_format="sharded_bucket") for c in clients]  # fmt: skip
    works = [torch.distributed.broadcast(buf, src=0, group=g, async_op=True) for (buf, _), g in zip(per_rank, blocks)]
    for w in works:
        w.wait()
    for t in threads:
        t.join(120)
    sums = [{s.name: flat_bucket.tensor_checksum(flat_bucket.view(buf, s)) for s in mine} for buf, mine in per_rank]
    return box, [buf.nbytes for buf, _ in per_rank], sums
