"""One trainable role of the learner (policy or value): its megatron model wrapped in DDP, the trainable
parameter selection, its (distributed) optimizer and its LR schedule. Built by learner/learner.py."""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sao.config.learner import Recompute, RoleOptimConfig, Routing
from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.learner.routing import RoutingReplay
from megatron_sao.models.builder import ModelSpec, Role, build_model, recompute_settings, transformer_config

logger = logging.getLogger(__name__)


@dataclass
class TrainableReport:
    trainable: list[str]
    frozen: list[str]
    trainable_numel: int
    frozen_numel: int

    def summary(self, role: str) -> str:
        total = self.trainable_numel + self.frozen_numel
        share = self.trainable_numel / max(total, 1)
        groups = sorted({_group(n) for n in self.trainable})
        return (
            f"{role}: {self.trainable_numel:,} of {total:,} parameters trainable on this rank ({share:.1%}); "
            f"trainable groups: {', '.join(groups) or 'none'}"
        )


def _group(name: str) -> str:
    """decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight -> mlp.experts.*.linear_fc1.weight"""
    parts = name.split(".")
    out = [p if not p.isdigit() else "*" for p in parts]
    if out[:3] == ["decoder", "layers", "*"]:
        out = out[3:]
    return ".".join(out)


def global_parameter_names(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) with the decoder layer numbered as in the whole model (HF's and the checkpoint's numbering),
    not as in this pipeline stage: `decoder.layers.26.mlp...` names the same layer at PP=1 and PP=2."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    local_to_global = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
                       for i, layer in enumerate(layers)}  # fmt: skip
    named = []
    for name, p in model.named_parameters():
        if name.startswith("decoder.layers."):
            local = ".".join(name.split(".")[:3]) + "."
            name = local_to_global.get(local, local) + name[len(local) :]
        named.append((name, p))
    return named


def trains(name: str, trainable: list[str], frozen: list[str]) -> bool:
    """A parameter trains when its (global) name matches a `trainable` pattern and no `frozen` one."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in trainable) and not any(
        fnmatch.fnmatchcase(name, pat) for pat in frozen
    )


def layer_selective(suffix: str, num_layers: int, trainable: list[str], frozen: list[str]) -> bool:
    """Whether the patterns train the parameter `decoder.layers.<i>.<suffix>` in some layers and not in others (then
    its optimizer state covers part of the layer-stacked checkpoint tensor: see learner/checkpoint.py)."""
    return len({trains(f"decoder.layers.{i}.{suffix}", trainable, frozen) for i in range(num_layers)}) > 1


def select_trainable(model: torch.nn.Module, trainable: list[str], frozen: list[str]) -> TrainableReport:
    """requires_grad = trains(name): fnmatch over parameter names, layers numbered globally."""
    report = TrainableReport([], [], 0, 0)
    for name, p in global_parameter_names(model):
        train = trains(name, trainable, frozen)
        p.requires_grad_(train)
        if train:
            report.trainable.append(name)
            report.trainable_numel += p.numel()
        else:
            report.frozen.append(name)
            report.frozen_numel += p.numel()
    return report


@dataclass
class RoleModel:
    role: Role
    config: Any  # megatron TransformerConfig of this role
    ddp: Any  # megatron DistributedDataParallel
    optimizer: Any  # megatron (Chained/Distributed) optimizer
    scheduler: Any  # megatron OptimizerParamScheduler
    report: TrainableReport
    tp_rank: int
    """This rank's tensor-parallel rank (DistContext.tp_rank): which vocabulary slice the policy's logits hold."""
    routing: RoutingReplay | None = None
    """Its routers fed with the engine's routes (learner/routing.py): replaying or only measuring; None: neither."""
    layer_selective: bool = False
    """The trainable patterns train some decoder layers and not others (roles.layer_selective): its optimizer state
    is checkpointed per layer (learner/checkpoint.py)."""
    optimizer_steps: int = 0
    applied_lr: float = 0.0
    """The learning rate of the last optimizer step (the scheduler has moved on to the next one's since)."""

    @property
    def model(self) -> Any:
        return self.ddp.module

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float]:
        """Optimizer step (with megatron's gradient clipping) and one scheduler step."""
        self.applied_lr = self.current_lr()
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            self.optimizer_steps += 1
        return bool(ok), float(grad_norm) if grad_norm is not None else float("nan")

    def reload_main_params(self) -> None:
        """After weights were written into the model outside the optimizer (HF load, weights-only load), refresh
        the optimizer's fp32 main copies (bf16 training keeps separate ones)."""
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            opt.reload_model_params()

    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return float(self.optimizer.param_groups[0]["lr"])


def _grad_into_frozen_embedding(model: Any) -> None:
    """Full recomputation checkpoints each layer with a reentrant autograd function, which gives no gradient to the
    layer's parameters when none of its inputs requires one: with the embedding frozen (the critic) the first
    layer's MLPs would silently stop training. The embedding's output is made to require a gradient instead."""
    embedding = getattr(model, "embedding", None)
    if embedding is None or any(p.requires_grad for p in embedding.parameters()):
        return

    def needs_grad(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output.requires_grad_() if torch.is_grad_enabled() and not output.requires_grad else output

    embedding.register_forward_hook(needs_grad)


def wrap_ddp_and_optimizer(
    model: Any, config: Any, optim: RoleOptimConfig, use_distributed_optimizer: bool
) -> tuple[Any, Any]:
    """megatron DDP around `model` (gradients reduced in fp32) and its Adam (distributed or not) with `optim`'s
    hyperparameters and gradient clipping; returns (ddp_model, optimizer). Only trainable parameters get buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return ddp, get_megatron_optimizer(opt_config, [ddp])


def warmup(optim: RoleOptimConfig) -> tuple[float, int]:
    """(init_lr, lr_warmup_steps) for megatron's scheduler so that optimizer step k (0, 1, ...) of a W-step warm-up
    runs at lr * (k + 1) / W: the first step already moves the weights (lr / W), step W - 1 is at the peak. Megatron
    interpolates init_lr -> max_lr over lr_warmup_steps, so that is init_lr = lr / W over W - 1 steps."""
    w = optim.warmup_steps
    return (optim.lr / w, w - 1) if w > 1 else (optim.lr, 0)


def build_role(
    spec: ModelSpec,
    parallel: ParallelConfig,
    role: Role,
    optim: RoleOptimConfig,
    *,
    tp_rank: int,
    total_steps: int,
    use_distributed_optimizer: bool,
    moe_aux_loss_coeff: float = 0.0,
    recompute: Recompute = "none",
    routing: Routing = "off",
) -> RoleModel:
    """Build, freeze, wrap and attach an optimizer; weights are still the random init (load them next). `tp_rank`:
    this rank's tensor-parallel rank (DistContext.tp_rank). `routing` (a MoE model): replay the engine's routes,
    only measure against them, or neither."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    aux = moe_aux_loss_coeff if role == "policy" else 0.0
    config = transformer_config(spec, parallel, moe_aux_loss_coeff=aux, moe_enable_routing_replay=routing != "off",
                                **recompute_settings(recompute))  # fmt: skip
    model = build_model(spec, config, role)
    replay = None
    if routing != "off":
        replay = RoutingReplay(model, routing == "replay", tp_rank, parallel.tensor, parallel.use_sequence_parallel)
    report = select_trainable(model, optim.trainable, optim.frozen)
    if recompute == "full":
        _grad_into_frozen_embedding(model)
    if report.trainable_numel == 0 and report.frozen_numel != 0:
        layers = sorted({int(n.split(".")[2]) for n in report.frozen if n.startswith("decoder.layers.")})
        where = f"layers {layers[0]}-{layers[-1]}" if layers else "no decoder layers"
        raise ValueError(f"learner.{role}.trainable {optim.trainable} (less learner.{role}.frozen) trains nothing on "
                         f"this rank ({where}): megatron's optimizer cannot hold or checkpoint an empty rank. Train "
                         "at least one parameter on every pipeline stage, or lower parallel.pipeline")  # fmt: skip
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    ddp, optimizer = wrap_ddp_and_optimizer(model, config, optim, use_distributed_optimizer)
    init_lr, ramp = warmup(optim)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=init_lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=ramp,
        lr_decay_steps=max(total_steps, ramp + 1),
        lr_decay_style=optim.schedule,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    suffixes = {n.split(".", 3)[3] for n in report.trainable + report.frozen if n.startswith("decoder.layers.")}
    selective = any(layer_selective(x, config.num_layers, optim.trainable, optim.frozen) for x in suffixes)
    return RoleModel(role, config, ddp, optimizer, scheduler, report, tp_rank, replay, layer_selective=selective)
