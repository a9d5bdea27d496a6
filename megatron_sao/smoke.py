"""A tiny megatron-core MoE GPT trained for a few steps: `python -m megatron_sao smoke` and the platform tests.

Owns nothing the learner uses: it is the smallest end-to-end proof that megatron-core (MoE, TP/SP, EP, PP,
DDP, distributed optimizer, dist_checkpointing) runs on this machine through the platform layer.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sao.config.parallel import ParallelConfig

VOCAB = 256
SEQ = 32


def tiny_transformer_config(parallel: ParallelConfig, dtype: str = "fp32", **overrides: Any) -> Any:
    """TransformerConfig of a 2-layer, 4-expert top-2 MoE with RMSNorm/SwiGLU, laid out by `parallel`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_sao.models.builder import numerics

    base: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.01,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,  # MoE LLMs have none; megatron's SequentialMLP bias path also breaks autograd
        hidden_dropout=0.0,
        attention_dropout=0.0,
        perform_initialization=True,
        **numerics(dtype, use_te=False),
        **parallel.megatron_sizes(),
        sequence_parallel=parallel.use_sequence_parallel,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def build_tiny_gpt(config: Any) -> Any:
    """A megatron GPTModel (local spec) holding this pipeline stage's layers."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor  # [b, 1, s, s] bool, True = masked out (megatron's convention)


def synthetic_batch(batch_size: int = 4, seq: int = SEQ, seed: int = 1234) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    return Batch(
        tokens=tokens,
        labels=torch.roll(tokens, -1, dims=1),
        position_ids=torch.arange(seq).expand(batch_size, -1).contiguous(),
        attention_mask=causal.view(1, 1, seq, seq).expand(batch_size, 1, seq, seq),
    )


def _microbatches(batch: Batch, num_microbatches: int) -> Iterator[Batch]:
    size = batch.tokens.shape[0] // num_microbatches
    for i in range(num_microbatches):
        sl = slice(i * size, (i + 1) * size)
        yield Batch(batch.tokens[sl], batch.labels[sl], batch.position_ids[sl], batch.attention_mask[sl])


def lm_forward_backward(model: Any, batch: Batch, num_microbatches: int = 2, forward_only: bool = False) -> list[float]:
    """Mean next-token loss per micro-batch, through megatron's schedule (1F1B when PP > 1).

    Returns the losses on the last pipeline stage and [] elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Iterator[Batch], chunk: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        out = chunk(mb.tokens, mb.position_ids, mb.attention_mask, labels=mb.labels)

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = per_token.float().mean()
            # clone: the schedule divides the returned loss by num_microbatches in place
            return loss, {"lm_loss": loss.detach().clone()}

        return out, loss_func

    mb_size = batch.tokens.shape[0] // num_microbatches
    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=_microbatches(batch, num_microbatches),
        model=[model],
        num_microbatches=num_microbatches,
        seq_length=batch.tokens.shape[1],
        micro_batch_size=mb_size,
        forward_only=forward_only,
    )
    return [float(r["lm_loss"]) for r in results]


def wrap_ddp_and_optimizer(model: Any, config: Any, use_distributed_optimizer: bool, lr: float = 1e-3) -> Any:
    """Megatron DDP around `model` plus its Adam (the learner's own wrapping); returns (ddp_model, optimizer)."""
    from megatron_sao.config.learner import RoleOptimConfig
    from megatron_sao.learner.roles import wrap_ddp_and_optimizer as wrap

    return wrap(model, config, RoleOptimConfig(lr=lr), use_distributed_optimizer)


def train_step(ddp: Any, optimizer: Any, batch: Batch, num_microbatches: int = 2) -> tuple[list[float], float]:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = lm_forward_backward(ddp, batch, num_microbatches)
    ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step skipped (non-finite gradients)")
    return losses, float(grad_norm)


def main(argv: Sequence[str] = ()) -> int:
    """Single process: build the tiny MoE, train a few steps with DDP + distributed optimizer, print losses."""
    p = argparse.ArgumentParser(prog="python -m megatron_sao smoke")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args(list(argv))

    from megatron_sao.distributed import destroy_distributed, init_distributed

    parallel = ParallelConfig()
    ctx = init_distributed(parallel, seed=1234)
    config = tiny_transformer_config(parallel, args.dtype)
    ddp, opt = wrap_ddp_and_optimizer(build_tiny_gpt(config), config, use_distributed_optimizer=True)
    batch = synthetic_batch()
    print(f"smoke: tiny megatron-core MoE GPT on {ctx.device} ({ctx.backend}), {args.dtype}", flush=True)
    first = last = 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses, grad_norm = train_step(ddp, opt, batch)
        last = sum(losses) / len(losses)
        first = first or last
        print(f"  step {step}: loss {last:.4f}  grad-norm {grad_norm:.3f}  {time.perf_counter() - t0:.2f}s", flush=True)
    destroy_distributed()
    if not last < first:
        print("smoke: FAILED, the loss did not go down")
        return 1
    print(f"smoke: ok, loss {first:.4f} -> {last:.4f}")
    return 0
