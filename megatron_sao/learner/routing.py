"""MoE routing replay (R3) in the learner: the policy routes each token to the experts the engine routed it to, by
megatron-core's own mechanism (`moe_enable_routing_replay`: every TopKRouter's `RouterReplay` hands back given top-k
indices, gathering the router's probabilities at them so the router keeps its gradient), and measures how often
its own router would have chosen otherwise (routing/mismatch_frac).

Owned here: giving each router its layer's slice of a micro-batch's routes (MicroBatch.routes, only this pipeline
stage's layers; this tensor-parallel rank's sequence chunk under sequence parallelism), recompute safety (a
backward that re-runs the forward takes the indices of the micro-batch being back-propagated: megatron's
REPLAY_BACKWARD queue, switched on by a hook on the micro-batch's output), and the mismatch statistics. Called by
learner/forward.py around every micro-batch; built by learner/roles.py for a model whose routers replay.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_sao.learner.packing import MicroBatch


def _replay_classes() -> tuple[type, type]:
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


class EngineRoutes:
    """One router's replay: megatron's RouterReplay, plus the measurement of its own choice against the engine's.

    `replay` off: the router routes by itself and only the disagreement is counted (rollout.return_routed_experts
    without learner.routing_replay)."""

    def __init__(self, layer: int, replay: bool) -> None:
        RouterReplay, action = _replay_classes()
        self.inner = RouterReplay()
        RouterReplay.global_router_replay_instances.remove(self.inner)  # owned per model here, not process-wide
        self.inner.get_replay_topk = self.get_replay_topk  # type: ignore[method-assign]
        self._action = action
        self.layer, self.replay = layer, replay
        self.valid: torch.Tensor | None = None  # bool [tokens]: positions the engine routed (not fillers, padding)
        self.mismatched = 0.0  # (token, layer) pairs whose top-k sets differ, over the valid ones
        self.decisions = 0.0

    def load(self, indices: torch.Tensor, valid: torch.Tensor) -> None:
        self.inner.set_target_indices(indices)  # also queued for a recomputing backward
        self.inner.set_router_replay_action(self._action.REPLAY_FORWARD)
        self.valid = valid

    def backward_begins(self) -> None:
        self.inner.set_router_replay_action(self._action.REPLAY_BACKWARD)

    def clear(self) -> None:
        self.inner.clear_indices()
        self.inner.clear_router_replay_action()
        self.valid = None

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        action = self.inner.router_replay_action
        if action is None:  # no routes loaded (e.g. a forward outside a step): the router's own choice
            return default_compute_topk(scores, topk, num_groups, group_topk)
        if action == self._action.REPLAY_BACKWARD:  # recompute: the same choice as this micro-batch's forward
            if self.replay:
                return RouterReplay.get_replay_topk(self.inner, scores, topk, num_groups, group_topk,
                                                    default_compute_topk)  # fmt: skip
            return default_compute_topk(scores, topk, num_groups, group_topk)
        own = default_compute_topk(scores, topk, num_groups, group_topk)
        self._count(own[1], self.inner.target_topk_idx.to(scores.device))
        if not self.replay:
            return own
        return RouterReplay.get_replay_topk(self.inner, scores, topk, num_groups, group_topk, default_compute_topk)

    @torch.no_grad()
    def _count(self, own: torch.Tensor, engine: torch.Tensor) -> None:
        chosen = (engine.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).all(-1)  # [tokens]: the same expert set
        valid = self.valid.to(own.device) if self.valid is not None else torch.ones_like(chosen)
        self.mismatched += float((~chosen & valid).sum())
        self.decisions += float(valid.sum())


class RoutingReplay:
    """The routers of one model on this rank (this pipeline stage's MoE layers), fed per micro-batch."""

    def __init__(self, model: torch.nn.Module, replay: bool, tp_rank: int, tp_size: int, sequence_parallel: bool):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers: list[tuple[TopKRouter, EngineRoutes]] = []
        for module in model.modules():
            if isinstance(module, TopKRouter) and module.router_replay is not None:
                routes = EngineRoutes(int(module.layer_number) - 1, replay)
                module.router_replay = routes.inner
                self.routers.append((module, routes))
        if not self.routers and any(isinstance(m, TopKRouter) for m in model.modules()):
            raise ValueError("the model's routers were built without moe_enable_routing_replay")
        self.replay = replay
        self.layers = sorted({r.layer for _, r in self.routers})
        """Global (HF) indices of this stage's MoE layers: the routes columns a micro-batch needs here."""
        self.split = (tp_rank, tp_size) if sequence_parallel and tp_size > 1 else None

    def load(self, mb: MicroBatch) -> None:
        """Hand each router its layer's top-k for `mb` (every position of the packed row, or this TP rank's chunk
        of it under sequence parallelism). A micro-batch without routes is refused: a replaying model cannot route
        by itself silently. A stage without MoE layers has nothing to load."""
        if not self.routers:
            return
        if mb.routes is None or mb.routed is None:
            raise ValueError("a micro-batch without routes reached a model that replays them: every trajectory of a "
                             "step needs routes (rollout.return_routed_experts)")  # fmt: skip
        routes, routed = mb.routes, mb.routed
        if self.split is not None:
            rank, size = self.split
            chunk = routes.shape[0] // size
            routes, routed = routes[rank * chunk : (rank + 1) * chunk], routed[rank * chunk : (rank + 1) * chunk]
        column = {layer: i for i, layer in enumerate(mb.route_layers)}
        for _, r in self.routers:
            r.load(routes[:, column[r.layer]].long(), routed)

    def backward_begins(self) -> None:
        for _, r in self.routers:
            r.backward_begins()

    def clear(self) -> None:
        for _, r in self.routers:
            r.clear()

    def take_stats(self) -> tuple[float, float]:
        """(mismatched, decisions) since the last call, summed over this rank's routers."""
        out = (sum(r.mismatched for _, r in self.routers), sum(r.decisions for _, r in self.routers))
        for _, r in self.routers:
            r.mismatched = r.decisions = 0.0
        return out


class _BackwardBegins(torch.autograd.Function):
    """Identity on a micro-batch's output whose backward runs first in that micro-batch's backward: it switches the
    routers to the queued indices, so a recomputing backward replays that micro-batch's routes, in order."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, routing: RoutingReplay) -> torch.Tensor:
        ctx.routing = routing
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.routing.backward_begins()
        return grad, None


def mark_backward(output: torch.Tensor, routing: RoutingReplay) -> torch.Tensor:
    return _BackwardBegins.apply(output, routing) if output.requires_grad else output
