"""Held-out evaluation (rollout/evaluate.py): pass@k against its definition, held-out prompts that training never
draws, and an evaluation pinned to one weight version even when the engine moves to another in its middle."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from megatron_sao.config import ConfigError, load_config
from megatron_sao.engines.client import EngineRouter, SGLangClient
from megatron_sao.rollout.envs import make_env
from megatron_sao.rollout.evaluate import Evaluation, Evaluator, heldout_prompts, pass_at_k
from megatron_sao.rollout.prompts import training_prompts, write_jsonl
from tests.engines.conftest import serve_in_thread


@pytest.mark.parametrize(("n", "c", "k"), [(4, 0, 1), (4, 1, 1), (4, 1, 2), (4, 2, 3), (5, 3, 5), (6, 6, 2)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_solved_one(n: int, c: int, k: int) -> None:
    solved = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(solved, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / math.comb(n, k))
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(n, c, n + 1)


def test_an_evaluation_reports_pass_at_1_and_k_over_complete_prompts() -> None:
    e = Evaluation(version=7, k=2, rewards={"a": [1.0, 0.0], "b": [0.0, 0.0], "c": [1.0]},
                   solved={"a": [True, False], "b": [False, False], "c": [True]})  # fmt: skip
    r = e.as_record()  # "c" is incomplete (one of two samples): left out
    assert r["eval/weight_version"] == 7 and r["eval/prompts"] == 2 and r["eval/samples"] == 4
    assert r["eval/pass@1"] == pytest.approx(0.25) and r["eval/pass@2"] == pytest.approx(0.5)
    assert r["eval/avg@2"] == pytest.approx(0.25) and r["eval/reward/mean"] == pytest.approx(0.25)


def test_held_out_prompts_are_never_training_prompts(tmp_path: Path) -> None:
    style = load_config(None, ["--rollout.env.name", "style_preference", "--eval.num_prompts", "5"])
    env = make_env("style_preference", {})
    held = heldout_prompts(style, env)
    train = {r["prompt"] for r in training_prompts(env, None)}
    assert len(held) == 5 and not {r["prompt"] for r in held} & train  # its own topics
    chain = load_config(None, ["--rollout.env.name", "key_chain", "--eval.num_prompts", "8"])
    env = make_env("key_chain", {})
    train_chains = {json.dumps(r["chain"], sort_keys=True) for r in training_prompts(env, None)}
    held = heldout_prompts(chain, env)
    assert len(held) == 8 and not {json.dumps(r["chain"], sort_keys=True) for r in held} & train_chains
    leaked = tmp_path / "eval.jsonl"
    write_jsonl(leaked, [{**r, "id": f"x{i}"} for i, r in enumerate(training_prompts(env, None)[:3])])
    given = load_config(None, ["--rollout.env.name", "key_chain", "--eval.prompts", str(leaked)])
    with pytest.raises(ValueError, match="3 of its prompts are training prompts"):
        heldout_prompts(given, env)
    with pytest.raises(ConfigError, match="greedy samples are all alike"):
        load_config(None, ["--eval.sampling.temperature", "0"])


def _evaluator(model: Path, url: str) -> Evaluator:
    from transformers import AutoTokenizer

    from megatron_sao.rollout.agent_loop import ChatTemplateCodec

    cfg = load_config(None, ["--model.hf_path", str(model), "--rollout.env.name", "style_preference",
                             "--eval.num_prompts", "4", "--eval.samples_per_prompt", "3", "--eval.budget", "1.0",
                             "--rollout.concurrency", "2", "--eval.sampling.max_new_tokens", "6"])  # fmt: skip
    codec = ChatTemplateCodec(AutoTokenizer.from_pretrained(str(model)))
    return Evaluator(cfg, make_env("style_preference", {}), codec, EngineRouter([SGLangClient(url)]))


def test_an_evaluation_measures_one_version_even_when_the_engine_moves_in_its_middle(
    tiny_dirs: dict[str, Path],
) -> None:
    served = serve_in_thread(tiny_dirs["qwen3_moe"])
    url = next(served)
    try:
        evaluator = _evaluator(tiny_dirs["qwen3_moe"], url)
        still = evaluator.run(0)
        assert not still.given_up and still.restarts == 0 and still.discarded == 0
        assert still.as_record()["eval/samples"] == 12 and still.as_record()["eval/weight_version"] == 0

        client = SGLangClient(url)

        def push_midway(done: int, total: int) -> None:
            if done == 5:  # weights (their version) change under the evaluation, between two of its samples
                client.update_weight_version(1, abort_all_requests=False)

        moved = evaluator.run(0, progress=push_midway)
        record = moved.as_record()
        assert moved.restarts == 1 and moved.discarded >= 1 and not moved.given_up
        assert record["eval/weight_version"] == 1 and record["eval/samples"] == 12  # all of them from version 1
    finally:
        served.close()
