"""Decoded samples of each step (run/samples.py): spread over the batch by reward, decoded with the model's
tokenizer into samples.jsonl and TensorBoard's text tab, once per step across a resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from megatron_sao.learner.synthetic import make_trajectory
from megatron_sao.run.metrics import MetricsLog
from megatron_sao.run.samples import SampleLog, spread


def _batch(n: int) -> list:
    rng = np.random.default_rng(0)
    return [make_trajectory(rng, i, reward=float(i), version=3) for i in range(n)]


def test_samples_are_spread_over_the_batch_by_reward_best_and_worst_first() -> None:
    batch = _batch(9)
    assert [t.header.reward for t in spread(batch, 2)] == [8.0, 0.0]
    assert [t.header.reward for t in spread(batch, 3)] == [8.0, 0.0, 4.0]
    assert len(spread(batch, 20)) == 9 and spread(batch, 1)[0].header.reward == 8.0


def test_a_steps_samples_are_decoded_into_the_file_and_tensorboard_once_per_step_across_a_resume(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoTokenizer

    from megatron_sao.models.tiny import make_tiny_model

    hf = make_tiny_model("qwen3_moe", tmp_path / "model", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    run = tmp_path / "run"
    run.mkdir()
    metrics = MetricsLog(run, tensorboard=True)
    samples = SampleLog(run, str(hf), 2, metrics)
    batch = _batch(5)
    for step in (1, 2, 3):
        samples.write(step, 3, batch)
    samples.close()
    metrics.close()
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3]
    best = max(batch, key=lambda t: t.header.reward)
    assert rows[0]["reward"] == 4.0 and rows[1]["reward"] == 0.0 and rows[0]["versions"] == [3, 3]
    assert rows[0]["prompt"] == tokenizer.decode([int(x) for x in best.tokens[: best.header.prompt_len]])
    assert rows[0]["response"] == tokenizer.decode([int(x) for x in best.tokens[best.header.prompt_len :]])
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/text_summary")
    assert [e.step for e in texts] == [1, 2, 3] and b"reward 4" in texts[0].tensor_proto.string_val[0]
    # a run resumed at step 2's checkpoint drops step 3's samples (trained again) and goes on
    again = SampleLog(run, str(hf), 2, None, resumed_at=2)
    again.write(3, 3, batch[:1])
    again.close()
    assert [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()] == [1, 1, 2, 2, 3]


def test_without_a_tokenizer_the_token_ids_are_written(tmp_path: Path) -> None:
    empty = tmp_path / "model"  # a model directory without a tokenizer
    empty.mkdir()
    samples = SampleLog(tmp_path, str(empty), 1)
    batch = _batch(2)
    samples.write(1, 0, batch)
    samples.close()
    (row,) = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    t = max(batch, key=lambda t: t.header.reward)
    assert row["prompt"] == " ".join(str(int(x)) for x in t.tokens[: t.header.prompt_len])
    assert SampleLog(tmp_path / "off", None, 0).file is None  # launch.samples_per_step 0: no file
