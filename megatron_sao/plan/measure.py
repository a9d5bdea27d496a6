"""What a built learner role really holds on this rank, to check the planner against: parameter, gradient-buffer and
optimizer-state bytes (every tensor counted once by its storage), and the bytes autograd keeps for backward during
one micro-batch's forward (saved tensors that are not parameters). Used by tests/plan and benchmarks/plan_check.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from megatron_sao.learner.roles import RoleModel
from megatron_sao.models.builder import ModelSpec


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def static_bytes(role: RoleModel) -> dict[str, int]:
    """{'weights', 'grads', 'optimizer'}: parameter storages, DDP gradient buffers, optimizer state and fp32 main
    parameter shards (storages shared with the parameters -- fp32 models -- are not counted again)."""
    params = {_storage(p.data) for p in role.model.parameters()}
    grads = set()
    for buffer in [*role.ddp.buffers, *role.ddp.expert_parallel_buffers]:
        grads.add(_storage(buffer.grad_data))
    opt: set[tuple[int, int]] = set()
    for inner in getattr(role.optimizer, "chained_optimizers", [role.optimizer]):
        for state in inner.optimizer.state.values():
            opt |= {_storage(v) for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"}
        for groups in getattr(inner, "shard_fp32_from_float16_groups", None) or []:
            opt |= {_storage(p) for p in groups}
    opt -= params
    return {
        "weights": sum(n for _, n in params),
        "grads": sum(n for _, n in grads),
        "optimizer": sum(n for _, n in opt),
    }


@contextmanager
def saved_activations(exclude: set[tuple[int, int]]) -> Iterator[Callable[[], int]]:
    """Inside: every tensor autograd saves for backward is recorded; the yielded function returns their bytes
    (unique storages, `exclude` -- the parameters -- left out)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> Any:
        ptr, n = _storage(t)
        if (ptr, n) not in exclude and ptr:
            seen[ptr] = max(seen.get(ptr, 0), n)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield lambda: sum(seen.values())


def parameter_storages(role: RoleModel) -> set[tuple[int, int]]:
    return {_storage(p.data) for p in role.model.parameters()}


def measure_roles(hf_dir: str, tokens: int, recompute: str) -> dict[str, Any]:
    """Per role: the static bytes after one optimizer step, the saved activations of one forward of `tokens`
    tokens, and the gradient norm that step produced."""
    from megatron_sao.config import load_config
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.forward import token_logprobs
    from megatron_sao.learner.roles import build_role

    cfg = load_config(None, ["--model.hf_path", hf_dir, "--model.dtype", "fp32", "--learner.recompute", recompute])
    layout = init_distributed(cfg.parallel, seed=7)
    spec = ModelSpec.from_config(cfg.model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (1, tokens), generator=g)
    positions = torch.arange(tokens).view(1, -1)
    mask = torch.triu(torch.ones(1, 1, tokens, tokens, dtype=torch.bool), diagonal=1)
    out: dict[str, Any] = {}
    for role, optim in (("policy", cfg.learner.policy), ("value", cfg.learner.value)):
        rm = build_role(spec, cfg.parallel, role, optim, tp_rank=layout.tp_rank, total_steps=1,
                        use_distributed_optimizer=True, recompute=recompute)  # fmt: skip
        rm.zero_grad()
        with saved_activations(parameter_storages(rm)) as saved:
            output = rm.model(ids, positions, mask)
            if role == "policy":
                logp = token_logprobs(
                    output.reshape(tokens, -1), ids.roll(-1, 1)[0], 1.0, spec.vocab_size, tp_rank=layout.tp_rank
                )
                loss = -logp.mean()
            else:
                loss = output.float().pow(2).mean()
            activations = saved()
        loss.backward()
        rm.ddp.finish_grad_sync()
        ok, grad_norm = rm.step()
        out[role] = {**static_bytes(rm), "activations": activations, "grad_norm": grad_norm, "ok": ok}
    destroy_distributed()
    return out
