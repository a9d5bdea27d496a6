"""Fixes for megatron-core functions that fail (or silently misbehave) without CUDA, Transformer Engine and apex.

Each `@register` names the function, the failure and the versions checked; tests/platform/ proves each one
(MoE with TP+SP, EP, PP, DDP + distributed optimizer, bit-exact dist_checkpointing resume on gloo).
Only platform.activate() imports this module: on a machine without CUDA it applies every patch; on a GPU without
Transformer Engine only those tagged NO_TE (their failure is TE's absence, not the CPU's).
"""

from __future__ import annotations

import functools
import inspect
import queue
from typing import Any

import torch

from megatron_sao.platform_layer.registry import NO_TE, register


@register(
    "jit-fuser-off",
    works_around="megatron.core.jit.jit_fuser (torch.compile on torch >= 2.2), which decorates fused kernels of "
    "modules imported after activation (e.g. fusions.fused_cross_entropy)",
    why="on CPU torch.compile would invoke inductor and a C++ toolchain at the first call of each fused function; "
    "the CPU path turns the fusion flags off and uses the eager functions",
)
def patch_jit_fuser() -> None:
    from megatron.core import jit

    jit.disable_jit_fuser()


@register(
    "moe-te-general-gemm-name",
    works_around="megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.forward",
    why="'NameError: name te_general_gemm is not defined' when Transformer Engine is absent (the import fallback "
    "never binds the name); seen on an H200 without TE too",
    tags=(NO_TE,),
)
def patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@register(
    "mla-have-te-flag",
    works_around="megatron.core.transformer.multi_latent_attention.MLASelfAttention.__init__ (module flag HAVE_TE)",
    why="'TypeError: isinstance() arg 2 must be a type' building MLA: importing megatron.core.extensions."
    "transformer_engine succeeds without Transformer Engine (its classes are None), so the module sets HAVE_TE=True "
    "and calls isinstance(linear_proj, None)",
    tags=(NO_TE,),
)
def patch_mla_have_te() -> None:
    import importlib.util

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


@register(
    "torch-norm-sequence-parallel",
    works_around="megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
    why="(1) 'AssertionError: sequence parallel not supported by torch LayerNorm'; megatron requires sequence "
    "parallelism for MoE + TP. The torch norm is built anyway and its parameters are tagged sequence_parallel "
    "so finalize_model_grads all-reduces their gradients over TP, which is what the TE/apex norms do; (2) the "
    "torch norm ignores config.params_dtype (fp32 weights in a bf16 model, where TE norms are bf16): the "
    "distributed optimizer then mixes fp32 and bf16 parameters in one param group and its checkpoint code "
    "pairs parameters with the wrong main params ('size of tensor a (128) must match ... (64)' saving glm4_moe "
    "in bf16). The weights are cast to params_dtype. Both come from TE's absence: on an H200 without TE the norms were "
    "fp32 in a bf16 model too ('Mismatch dtype between input and weight ... Cannot dispatch to fused implementation')",
    tags=(NO_TE,),
)
def patch_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "_megatron_sao", False):
        return

    def new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any) -> Any:
        sequence_parallel = config.sequence_parallel
        object.__setattr__(config, "sequence_parallel", False)
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            object.__setattr__(config, "sequence_parallel", sequence_parallel)
        norm.to(dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm

    new._megatron_sao = True  # type: ignore[attr-defined]
    torch_norm.WrappedTorchNorm.__new__ = new  # type: ignore[method-assign]


@register(
    "moe-split-sizes-to-host",
    works_around="megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu (used by "
    "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)",
    why="'TypeError: all_to_all_single(): incompatible function arguments' at EP>1: upstream converts the split "
    "sizes to numpy only for CUDA tensors, so CPU split sizes stay tensors",
)
def patch_split_sizes_to_host() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


@register(
    "checkpoint-results-queue",
    works_around="megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue",
    why="a synchronous torch_dist save starts a 'spawn' multiprocessing Manager: ~8 s per process, and it "
    "re-imports __main__ (hangs scripts without a main guard). A synchronous save puts and reads its results in "
    "the same process, so an in-process queue.Queue serves (an mp.Queue would race its feeder thread: "
    "'results_queue should not be empty'); the CPU path makes only synchronous saves",
)
def patch_checkpoint_results_queue() -> None:

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results: queue.Queue = queue.Queue()

    def get_write_results_queue() -> Any:
        return results

    filesystem_async._get_write_results_queue = get_write_results_queue


def _restore_adam_steps(dist_opt: Any) -> None:
    """Give every torch-Adam parameter state the step count stored in its param group.

    Without apex/TE, DistributedOptimizer keeps the iteration in param_group["step"] in checkpoints, but the
    dp_reshardable load copies each parameter's "step" from the dummy state made before loading (1), so the
    next update used the wrong bias correction (silently: exp_avg/exp_avg_sq/params are exact).
    """
    inner = dist_opt.optimizer
    for group in inner.param_groups:
        if group.get("step") is None:
            continue
        step = torch.tensor(float(group["step"]), dtype=torch.float32)
        for p in group["params"]:
            state = inner.state.get(p)
            if state is not None and "step" in state:
                state["step"] = step.clone()


def _init_fresh_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """The state torch.optim.Adam creates lazily in its first step(): step 0 and zero moments (same dtypes), so
    that a checkpoint saved before any step has something to save and the first real step is unchanged."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


@register(
    "distopt-load-torch-adam",
    works_around="megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.sharded_state_dict "
    "and DistributedOptimizer.load_state_dict, with torch.optim.Adam (no apex/TE)",
    why="(1) 'AssertionError' at 'assert len(steps) == 1' in state_dict(): a fresh torch Adam has no state, so "
    "dummy state is made first; (2) 'a view of a leaf Variable that requires grad is being used in an in-place "
    "operation' (fp32 main params are views of model params), so the load runs under no_grad; (3) SILENT: after "
    "a dp_reshardable load every per-parameter Adam 'step' is 1 instead of the saved iteration, so the next "
    "update differs from an uninterrupted run; the saved step is restored; (4) 'KeyError: step' loading the "
    "fully_reshardable format (DistributedOptimizer._set_main_param_and_optimizer_states copies every torch-Adam "
    "state key, but that format carries 'step' in the param groups only): the missing key is left to (3); (5) the "
    "same assertion when SAVING before the first step (a checkpoint right after loading weights): torch Adam's "
    "own fresh state (step 0, zero moments) is created, which its first step() would have made identically",
)
def patch_distributed_optimizer_load() -> None:
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    if getattr(cls.load_state_dict, "_megatron_sao", False) or dopt.HAVE_APEX_OR_TE:
        return
    original_sharded_state_dict = cls.sharded_state_dict
    original_load_state_dict = cls.load_state_dict

    signature = inspect.signature(original_sharded_state_dict)

    @functools.wraps(original_sharded_state_dict)
    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        if len(self.optimizer.state) == 0:
            if bound.arguments.get("is_loading", False):
                self._init_optimizer_states_with_dummy_values()  # overwritten by the load
            else:
                _init_fresh_adam_state(self.optimizer)
        return original_sharded_state_dict(self, *args, **kwargs)

    @functools.wraps(original_load_state_dict)
    def load_state_dict(self: Any, state_dict: Any) -> Any:
        with torch.no_grad():
            out = original_load_state_dict(self, state_dict)
        _restore_adam_steps(self)
        return out

    original_set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(original_set_states)
    def set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> Any:
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}  # copy onto itself; the real value comes from (3)
        return original_set_states(self, model_param, tensors)

    load_state_dict._megatron_sao = True  # type: ignore[attr-defined]
    cls.sharded_state_dict = sharded_state_dict
    cls.load_state_dict = load_state_dict
    cls._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
