"""Logit parity between transformers and the converted megatron model, at any TP/EP/PP. CLI: tools/check_parity.py.

The HF model runs in fp32 with transformers; the megatron model is built by `builder.build_model` at the asked
layout, loads the converted checkpoint with `load_model_weights`, and runs the same tokens through megatron's
pipeline schedule (`get_forward_backward_func`, forward only), which hands the last stage's output to a
collecting function that gathers the vocab-parallel logits over TP. Several layouts can run in one set of ranks
(`layout_logits` switches layouts with destroy_distributed(keep_process_group=True)), which is how the tests
compare TP=1, TP=2, EP=2 and PP=2 with one spawn.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_sao.config.parallel import ParallelConfig
from megatron_sao.models.builder import ModelSpec

DEFAULT_TOL = 1e-4


def sample_tokens(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """A reproducible token batch [batch, seq] (int64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [batch, seq, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def megatron_logits(model: Any, tokens: torch.Tensor, vocab_size: int, last_stage: bool) -> torch.Tensor | None:
    """Run `tokens` [batch, seq] through this rank's pipeline stage of `model` (forward only); the last stage
    (`last_stage`: DistContext.is_last_stage()) returns the full logits [batch, seq, vocab_size] (gathered
    over TP, padding columns cut), others None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1).expand(batch, 1, seq, seq)

    def collect(output: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        return gather_from_tensor_model_parallel_region(output)[..., :vocab_size].float().cpu()

    def forward_step(data_iterator: Any, stage: Any) -> tuple[torch.Tensor, Any]:
        tok, pos, att = next(data_iterator)
        return stage(tok, pos, att), partial(collect)

    model.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([(tokens, position_ids, mask)]),
            model=[model],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
            collect_non_loss_data=True,
        )
    return out[0] if last_stage else None


def layout_logits(
    hf_dir: str, ckpt_dir: str, layouts: dict[str, ParallelConfig], tokens: torch.Tensor
) -> dict[str, torch.Tensor | None]:
    """On every rank of a job: for each layout, build the model, load `ckpt_dir`, return this rank's logits
    (None off the last pipeline stage). Leaves the process group up; tears megatron's parallel state down."""
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.models.builder import build_model, transformer_config
    from megatron_sao.models.checkpoint import load_model_weights

    spec = ModelSpec.from_hf_dir(hf_dir)
    out: dict[str, torch.Tensor | None] = {}
    for name, parallel in layouts.items():
        destroy_distributed(keep_process_group=True)
        layout = init_distributed(parallel, seed=4321)
        model = build_model(spec, transformer_config(spec, parallel, perform_initialization=False))
        load_model_weights(model, ckpt_dir, spec=spec)
        out[name] = megatron_logits(model, tokens, spec.vocab_size, layout.is_last_stage())
    destroy_distributed(keep_process_group=True)
    return out


def world_size_for(parallel: ParallelConfig) -> int:
    """The fewest ranks holding `parallel` (DP fills the rest): lcm of TP*PP*CP and EP*ETP*PP."""
    dense = parallel.tensor * parallel.pipeline * parallel.context
    experts = parallel.expert * parallel.resolved_expert_tensor * parallel.pipeline
    return math.lcm(dense, experts)


@dataclass(frozen=True)
class ParityResult:
    max_abs_diff: float
    """Largest |megatron - transformers| logit difference over every rank that produced logits."""
    max_abs_logit: float
    """Largest |transformers logit| (the scale the difference compares to)."""
    world_size: int
    tol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tol


def _parity_rank(hf_dir: str, ckpt_dir: str, parallel: ParallelConfig, tokens: torch.Tensor) -> Any:
    """One rank of check_parity: its logits as a numpy array (tensors do not survive the rank's exit in
    torch.multiprocessing's shared-memory pickling), or None off the last stage."""
    from megatron_sao.distributed import destroy_distributed

    logits = layout_logits(hf_dir, ckpt_dir, {"layout": parallel}, tokens)["layout"]
    destroy_distributed()
    return None if logits is None else logits.numpy()


def check_parity(
    hf_dir: str | Path,
    parallel: ParallelConfig,
    *,
    ckpt_dir: str | Path | None = None,
    tol: float = DEFAULT_TOL,
    batch: int = 2,
    seq: int = 16,
    seed: int = 0,
    progress: bool = False,
    timeout_s: float = 900.0,
) -> ParityResult:
    """Compare transformers' logits with the megatron model converted from `hf_dir` (or loaded from `ckpt_dir`)
    at `parallel`; spawns `world_size_for(parallel)` local ranks when above 1 (gloo on CPU, NCCL on GPU)."""
    from megatron_sao.convert.hf_to_megatron import convert_hf_to_megatron
    from megatron_sao.distributed import spawn_ranks

    if seq % parallel.tensor:
        raise ValueError(f"seq={seq} must be a multiple of tensor-parallel size {parallel.tensor} (sequence parallel)")
    if not torch.cuda.is_available() and parallel.expert > 1 and parallel.resolved_expert_tensor > 1:
        raise ValueError(
            f"EP={parallel.expert} with expert-TP={parallel.resolved_expert_tensor} does not run on gloo (megatron's "
            f"alltoall dispatcher all-gathers uneven token counts); pass --etp 1"
        )
    spec = ModelSpec.from_hf_dir(hf_dir)
    tokens = sample_tokens(spec.vocab_size, batch, seq, seed)
    reference = hf_logits(hf_dir, tokens)
    world = world_size_for(parallel)
    with tempfile.TemporaryDirectory(prefix="sao_parity_") as tmp:
        if ckpt_dir is None:
            ckpt_dir = convert_hf_to_megatron(hf_dir, Path(tmp) / "ckpt", dtype="fp32", progress=progress)
        if world == 1:
            results = [_parity_rank(str(hf_dir), str(ckpt_dir), parallel, tokens)]
        else:
            results = spawn_ranks(
                _parity_rank, world, str(hf_dir), str(ckpt_dir), parallel, tokens, timeout_s=timeout_s
            )
    diffs = [float((torch.from_numpy(r) - reference).abs().max()) for r in results if r is not None]
    if not diffs:
        raise RuntimeError("no rank returned logits (the last pipeline stage should)")
    return ParityResult(max(diffs), float(reference.abs().max()), world, tol)
