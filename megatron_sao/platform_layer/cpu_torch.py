"""CPU stand-ins for the torch.cuda entry points megatron-core calls, and the device-remapping mode.

megatron-core assumes CUDA: `torch.cuda.current_device()` as a device argument (about 175 call sites),
`device="cuda"` literals (e.g. pipeline_parallel/schedules.py), CUDA streams/events in the MoE token
dispatcher, and the CUDA RNG in tensor_parallel/random.py. On a CPU-only torch build these raise
"Torch not compiled with CUDA enabled". Only platform.activate() imports this module, and only without CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_sao.platform_layer.registry import register

CPU = torch.device("cpu")


def _to_cpu_device(dev: Any) -> Any:
    if isinstance(dev, int) and not isinstance(dev, bool):
        return CPU
    if isinstance(dev, str) and dev.startswith("cuda"):
        return CPU
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return CPU
    return dev


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of torch functions and Tensor methods to the CPU.

    Not active inside autograd's backward (torch runs backward without modes), which is why
    `torch.cuda.current_device()` must itself return a CPU device.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            if "device" in kwargs:
                kwargs = {**kwargs, "device": _to_cpu_device(kwargs["device"])}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
        name = getattr(func, "__name__", None)
        if name == "to" and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        elif name in ("cuda", "pin_memory"):
            return args[0]
        return func(*args, **(kwargs or {}))


class _Stream:
    """No-op stand-in for torch.cuda.Stream (CPU work is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0

    @property
    def cuda_stream(self) -> int:
        return 0


class _Event:
    """No-op stand-in for torch.cuda.Event."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _Event) -> float:
        return 0.0


_DEFAULT_STREAM = _Stream()
_mode: CpuDeviceMode | None = None


def _noop() -> Any:
    """A fresh do-nothing function (one object per attribute: torch.compile's trace rules reject one function
    registered under several torch.cuda names)."""

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    return noop


@register(
    "torch-cuda-device-api",
    works_around="torch.cuda.current_device/device_count/set_device/synchronize/empty_cache/memory_* "
    "(called throughout megatron.core, e.g. TopKRouter.forward, tensor_parallel.layers backward)",
    why="'Torch not compiled with CUDA enabled'; current_device() must return torch.device('cpu') because it is "
    "used as a device= argument inside autograd backward, where no TorchFunctionMode is active",
)
def patch_cuda_device_api() -> None:
    c = torch.cuda
    c.current_device = lambda: CPU
    c.device_count = lambda: 1
    c.set_device = _noop()
    c.synchronize = _noop()
    c.empty_cache = _noop()
    c.memory_allocated = lambda *a, **k: 0
    c.max_memory_allocated = lambda *a, **k: 0
    c.memory_reserved = lambda *a, **k: 0
    c.reset_peak_memory_stats = _noop()
    c.nvtx.range_push = _noop()
    c.nvtx.range_pop = _noop()
    torch.Tensor.record_stream = lambda self, *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self


@register(
    "torch-cuda-streams",
    works_around="torch.cuda.Stream/Event/current_stream/stream (MoEAlltoAllTokenDispatcher.__init__, "
    "DistributedDataParallel communication streams)",
    why="'torch.cuda.Stream requires CUDA support'; CPU ops are synchronous, so no-op streams are exact",
)
def patch_cuda_streams() -> None:
    c = torch.cuda
    c.Stream = _Stream
    c.ExternalStream = _Stream
    c.Event = _Event
    c.current_stream = lambda *a, **k: _DEFAULT_STREAM
    c.default_stream = lambda *a, **k: _DEFAULT_STREAM
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.set_stream = _noop()


@register(
    "cuda-rng-is-cpu-rng",
    works_around="torch.cuda.get_rng_state/set_rng_state/manual_seed and "
    "megatron.core.tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state "
    "(CudaRNGStatesTracker.add/fork, model_parallel_cuda_manual_seed)",
    why="'Torch not compiled with CUDA enabled' when seeding; on CPU the tracker's states must drive the CPU "
    "generator that dropout uses. torch.cuda.manual_seed_all becomes a no-op because torch.manual_seed calls it",
)
def patch_cuda_rng() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    c = torch.cuda
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    c.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    c.manual_seed_all = _noop()
    c.random.get_rng_state = c.get_rng_state
    c.random.set_rng_state = c.set_rng_state
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()


@register(
    "tensor-type-reports-cuda",
    works_around="DistributedOptimizer._build_model_and_main_param_groups, "
    "Float16OptimizerWithFloat16Params.__init__, clip_grads.clip_grad_by_total_norm_fp32 (string compares of "
    "Tensor.type() against 'torch.cuda.FloatTensor'/'torch.cuda.BFloat16Tensor')",
    why="'TypeError: Wrapped parameters must be one of torch.cuda.FloatTensor, ... Received torch.FloatTensor'; "
    "the no-argument form of Tensor.type() reports CPU tensors under their CUDA type names",
)
def patch_tensor_type() -> None:
    original = torch.Tensor.type
    if getattr(original, "_megatron_sao", False):
        return

    def tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and not name.startswith("torch.cuda."):
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return original(self, dtype, non_blocking, **kwargs)

    tensor_type._megatron_sao = True  # type: ignore[attr-defined]
    torch.Tensor.type = tensor_type  # type: ignore[method-assign]


@register(
    "cuda-device-arguments",
    works_around="device='cuda' literals and .cuda()/.to(int) calls in megatron.core (e.g. "
    "pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving total_num_tokens, "
    "DistributedOptimizer buffers, dist_checkpointing loads)",
    why="'Torch not compiled with CUDA enabled' at PP>1, in DDP/optimizer and in checkpoint loads; a global "
    "TorchFunctionMode rewrites those device arguments to the CPU (and drops pin_memory)",
)
def enter_cpu_device_mode() -> None:
    global _mode
    if _mode is None:
        _mode = CpuDeviceMode()
        _mode.__enter__()  # stays on for the rest of the process
