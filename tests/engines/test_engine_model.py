"""The embedded engine's model path: log-probs match transformers' forward, batching with the slot cache is exact.

Tolerance: fp32 models, |engine log-prob - transformers log-prob| <= 1e-4 per token (measured ~5e-7; the gap is
summation order between a cached decode and a full-sequence forward).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from megatron_sao.engines.embedded.model_runner import SamplingParams, load_hf_model
from megatron_sao.engines.embedded.scheduler import Request, Scheduler
from megatron_sao.engines.embedded.server import build_state

TOL = 1e-4


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / T) of each output token under one full-sequence transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def run(scheduler: Scheduler, prompts: list[list[int]], params: SamplingParams) -> list[Request]:
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        scheduler.submit(r)
    for r in reqs:
        assert r.done.wait(120)
    return reqs


@pytest.mark.parametrize(
    ("family", "new_tokens"),
    # glm_moe_dsa: DSA's top-k (index_topk=16) breaks ties in an implementation-defined order, so its sequences stay
    # within 16 tokens, where the selection keeps every key and the comparison is exact.
    [("qwen3_moe", 24), ("glm4_moe", 24), ("glm_moe_dsa", 9)],
)
def test_engine_logprobs_match_transformers_forward(family: str, new_tokens: int, tiny_dirs: dict[str, Path]) -> None:
    state = build_state(str(tiny_dirs[family]), max_running=4)
    try:
        prompts = [[1, 9, 17, 33, 40, 41, 7], [3, 4], [5, 6, 7, 8, 9]]  # different lengths decode together
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        reqs = run(state.scheduler, prompts, params)
    finally:
        state.scheduler.stop()
    model = load_hf_model(tiny_dirs[family])
    for r in reqs:
        assert len(r.output_ids) == new_tokens
        ref = reference_logprobs(model, r.input_ids, r.output_ids)
        assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) <= TOL
        with torch.no_grad():  # greedy tokens are the argmax of the reference too
            logits = model(torch.tensor([r.input_ids + r.output_ids])).logits[0]
        assert logits[len(r.input_ids) - 1 : -1].argmax(-1).tolist() == r.output_ids


def test_sampled_logprob_is_under_the_temperature_scaled_distribution(tiny_dirs: dict[str, Path]) -> None:
    state = build_state(str(tiny_dirs["qwen3_moe"]), max_running=2)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, ignore_eos=True, sampling_seed=1)
        (r,) = run(state.scheduler, [[1, 2, 3, 4]], params)
        (again,) = run(state.scheduler, [[1, 2, 3, 4]], params)
    finally:
        state.scheduler.stop()
    assert again.output_ids == r.output_ids  # sampling_seed makes sampling reproducible
    ref = reference_logprobs(load_hf_model(tiny_dirs["qwen3_moe"]), r.input_ids, r.output_ids, temperature=0.7)
    assert max(abs(a - b) for a, b in zip(r.output_logprobs, ref)) <= TOL  # before top-k truncation, as SGLang


def test_concurrent_requests_join_and_leave_the_running_batch(tiny_dirs: dict[str, Path]) -> None:
    state = build_state(str(tiny_dirs["qwen3_moe"]), max_running=3)  # fewer slots than requests: some must wait
    s = state.scheduler
    try:
        lengths = [3, 17, 6, 11, 2, 9]
        reqs = [Request(f"r{i}", [1, 2 + i, 3], SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
                for i, n in enumerate(lengths)]  # fmt: skip
        threads = [threading.Thread(target=s.submit, args=(r,)) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.done.wait(120) for r in reqs)
        batched = [r.output_ids for r in reqs]
        batched_steps = s.stats["decode_steps"]
        alone = [run(s, [r.input_ids], r.params)[0].output_ids for r in reqs]
        assert [len(b) for b in batched] == lengths
        assert batched == alone
        assert batched_steps < sum(lengths) - len(lengths)  # requests shared decode steps
        assert s.cache.free_slots == 3
    finally:
        s.stop()


def test_a_model_dir_without_weights_is_named_without_a_traceback(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    import pytest

    from megatron_sao.engines.embedded.model_runner import load_engine_model

    shutil.copy(tiny_dirs["qwen3_moe"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"holds config.json but no weights \(\*.safetensors\)"):
        load_engine_model(tmp_path)
