"""Forward passes of the learner through megatron's schedule (so pipeline parallelism works), and what the
policy and value outputs become: per-position log-probs (vocab-parallel, never gathering the vocabulary)
and per-position values. Called by learner/step.py and the parity tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from megatron_sao.learner.packing import MicroBatch
from megatron_sao.learner.routing import RoutingReplay, mark_backward

LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]
"""(micro-batch, model output) -> (summed loss, token count, metrics); megatron divides gradients by the
step's total token count (calculate_per_token_loss)."""


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, *,
                   tp_rank: int) -> torch.Tensor:  # fmt: skip
    """log softmax(logits / temperature)[target] per position, from vocab-parallel logits.

    Args:
        logits: [..., V_padded / TP] this TP rank's slice of the vocabulary (any leading shape, e.g. [1, S]).
        targets: int64 with the leading shape of logits: the token each position predicts.
        temperature: the engines' sampling temperature (rollout.sampling.temperature).
        vocab_size: the real vocabulary; padded rows past it are excluded from the softmax.
        tp_rank: this rank's tensor-parallel rank (DistContext.tp_rank, RoleModel.tp_rank), which says which
            vocabulary slice it holds.
    Returns:
        float32 with the leading shape of logits. Gradient flows into logits.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / temperature
    part = scaled.shape[-1]
    first = tp_rank * part
    if first + part > vocab_size:  # this rank holds padding rows
        cols = torch.arange(first, first + part, device=scaled.device)
        scaled = scaled.masked_fill(cols >= vocab_size, float("-inf"))
    lead = scaled.shape[:-1]
    nll = vocab_parallel_cross_entropy(scaled.reshape(-1, 1, part), targets.reshape(-1, 1).to(scaled.device))
    return -nll.reshape(lead)


def _to_device(mb: MicroBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    mask = None if mb.attention_mask is None else mb.attention_mask.to(device, non_blocking=True)
    return mb.tokens.to(device, non_blocking=True), mb.position_ids.to(device, non_blocking=True), mask


def run_microbatches(
    model: Any,
    microbatches: Sequence[MicroBatch],
    loss_fn: LossFn,
    forward_only: bool,
    routing: RoutingReplay | None = None,
) -> list[dict[str, Any]]:
    """One pass over `microbatches` through get_forward_backward_func; returns the loss_fn metrics per
    micro-batch (last pipeline stage; [] elsewhere). With forward_only=False gradients accumulate in the
    model's DDP buffers. `routing`: each micro-batch's routers get its routes (learner/routing.py)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device

    def forward_step(data_iterator: Iterator[MicroBatch], chunk: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        tokens, positions, mask = _to_device(mb, device)
        if routing is not None:
            routing.load(mb)
        output = chunk(tokens, positions, mask, packed_seq_params=mb.packed_seq_params)
        if routing is not None:
            output = mark_backward(output, routing)
        return output, lambda out: loss_fn(mb, out)

    try:
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=max(mb.seq_len for mb in microbatches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        if routing is not None:
            routing.clear()


def _collect(
    model: Any,
    microbatches: Sequence[MicroBatch],
    out: torch.Tensor,
    per_position: Callable[..., torch.Tensor],
    routing: RoutingReplay | None = None,
) -> bool:
    """Forward-only pass writing `per_position(micro_batch, output)` ([S] floats) into `out` [B, L] (shifted
    layout). Returns False on ranks that are not the last pipeline stage (they hold no outputs)."""

    def loss_fn(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        values = per_position(mb, output).detach()
        return values.new_zeros(()), torch.zeros((), dtype=torch.int), {"values": values.cpu()}

    results = run_microbatches(model, microbatches, loss_fn, forward_only=True, routing=routing)
    if not results:
        return False
    for mb, r in zip(microbatches, results):
        mb.unpack_into(r["values"], out)
    return True


def collect_values(
    model: Any, microbatches: Sequence[MicroBatch], out: torch.Tensor, routing: RoutingReplay | None = None
) -> bool:
    """Value model: V(position) into `out` [B, L]; False off the last pipeline stage."""
    return _collect(model, microbatches, out, lambda mb, output: output.reshape(-1).float(), routing)


def collect_logprobs(
    model: Any,
    microbatches: Sequence[MicroBatch],
    out: torch.Tensor,
    temperature: float,
    vocab_size: int,
    routing: RoutingReplay | None = None,
    *,
    tp_rank: int,
) -> bool:
    """Policy model: log-probs of each predicted token into `out` [B, L]; False off the last pipeline stage.
    `tp_rank`: this rank's tensor-parallel rank (which vocabulary slice its logits hold)."""

    def logprobs(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
        return token_logprobs(output.reshape(mb.seq_len, -1), mb.targets(), temperature, vocab_size, tp_rank=tp_rank)

    return _collect(model, microbatches, out, logprobs, routing)
