"""Shared pytest setup: one intra-op thread per process (ranks are spawned with one each too); a test that starts a
process must be marked `multiproc`, so that `./tests/run.sh --unit` runs in-process tests only."""

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _processes_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fails a test not marked `multiproc` that starts a process (subprocess or multiprocessing), naming it."""
    if request.node.get_closest_marker("multiproc") or request.node.get_closest_marker("gpu"):
        yield
        return
    started: list[str] = []
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def popen(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        started.append(args if isinstance(args, str) else " ".join(map(str, args)))  # type: ignore[call-overload]
        popen_init(self, args, *rest, **kwargs)  # type: ignore[arg-type]

    def start(self: multiprocessing.process.BaseProcess) -> None:
        started.append(f"multiprocessing {self.name}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} starts {len(started)} process(es) ({started[0][:160]}) but is not marked "
                    "multiproc: add @pytest.mark.multiproc", pytrace=False)  # fmt: skip
