"""The critic's scalar head: replaces a GPTModel's output_layer, so the value model is the policy's backbone
with a different head (a spec choice, not a fork of the model). Used by models/builder.py.

The head starts at zero (weight and bias), so a new critic predicts one constant for every token; the learner sets
that constant, the bias, to the mean return of the first batch it trains on (`Learner._fit_value_bias`), which
gives an explained variance of exactly 0 before the first update instead of a negative one. A random head
(N(0, 0.02^2) on the hidden size) put a per-token spread of ~0.21 on returns of std ~0.5 and held the explained
variance near -0.17 for the first ~20 Adam steps (issue 24)."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


class ValueHead(MegatronModule):
    """hidden [s, b, h] (sequence-parallel chunk when SP is on) -> values [s, b, 1], replicated over TP.

    With sequence parallelism the head runs on each rank's sequence chunk and the scalar outputs are gathered;
    its parameters are tagged `sequence_parallel` so megatron all-reduces their partial gradients over TP.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config=config)
        self.sequence_parallel = bool(config.sequence_parallel)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        # Zero: the same head at every parallel layout and on every rank (it is replicated over TP).
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))
        for p in (self.weight, self.bias):
            p.sequence_parallel = self.sequence_parallel

    def forward(
        self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        if self.sequence_parallel:
            # Every TP rank computes the same loss on the gathered values, so backward only splits.
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None
