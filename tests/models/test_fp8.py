"""Block-wise FP8 (models/fp8.py): quantizing a weight block by block and back stays within e4m3's precision of each
block's largest value; a checkpoint written as block-FP8 is read back with its block size and its quantized names;
the embedded engine serves it on the dequantized weights and refuses a push of unquantized bytes, naming the dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_sao.models import fp8


def test_quantize_is_within_e4m3_precision_of_each_block() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 70)  # columns of very different scales: blocks matter
    q, scale = fp8.quantize(w, (16, 32))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert tuple(scale.shape) == (3, 3)  # ceil(40/16) x ceil(70/32)
    back = fp8.dequantize(q, scale, (16, 32), torch.float32)
    for i in range(3):
        for j in range(3):
            block = (slice(16 * i, 16 * i + 16), slice(32 * j, 32 * j + 32))
            amax = w[block].abs().max()
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 at full scale, absolute error <= amax / 2^4
            assert (back[block] - w[block]).abs().max() <= amax / 16 + 1e-12
    assert torch.equal(fp8.quantize(torch.zeros(4, 4), (2, 2))[1], torch.ones(2, 2))  # an all-zero block: scale 1
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize(torch.zeros(3), (2, 2))


def test_a_written_checkpoint_reads_back_its_format(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    fmt = fp8.write_checkpoint(tiny_models["qwen3_moe"], tmp_path / "fp8", block=(16, 16))
    assert fmt.block == (16, 16) and fmt.names
    assert all(n.endswith("proj.weight") for n in fmt.names)
    assert not any("norm" in n or "embed" in n or n.endswith("mlp.gate.weight") for n in fmt.names)
    assert fp8.checkpoint_format(tmp_path / "fp8") == fmt
    assert fp8.checkpoint_format(tiny_models["qwen3_moe"]) is None
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"].pop("weight_block_size")  # per-tensor FP8: pushes cannot be fed
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not block-wise"):
        fp8.checkpoint_format(tmp_path / "fp8")
    assert fp8.main([str(tiny_models["qwen3_moe"]), str(tmp_path / "cli"), "--block", "32", "32"]) == 0
    assert fp8.checkpoint_format(tmp_path / "cli").block == (32, 32)  # type: ignore[union-attr]


def test_the_embedded_engine_serves_fp8_and_refuses_unquantized_pushes(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from megatron_sao.engines.embedded.model_runner import load_engine_model
    from megatron_sao.engines.embedded.weights import WeightUpdater
    from megatron_sao.engines.protocol import ServerProtocol

    fmt = fp8.write_checkpoint(tiny_models["qwen3_moe"], tmp_path / "fp8", block=(16, 16))
    reference, none = load_engine_model(tiny_models["qwen3_moe"], "float32")
    model, served = load_engine_model(tmp_path / "fp8", "float32")
    assert none is None and served is not None and set(served.fmt.names) == set(fmt.names)
    tokens = torch.tensor([[3, 17, 29, 5, 11, 7, 2]])
    with torch.no_grad():
        ref_logp, q_logp = (torch.log_softmax(m(tokens).logits[0], -1) for m in (reference, model))
    top = ref_logp.argmax(-1, keepdim=True)  # the tokens greedy decoding picks: their log-probs under both
    assert (ref_logp.gather(-1, top) - q_logp.gather(-1, top)).abs().max() <= 0.1
    updater = WeightUpdater(model, ServerProtocol("0.5.23", embedded=True), fp8=served)
    name = sorted(fmt.names)[0]
    shape = tuple(updater.tensors[name].shape)
    problem, _ = updater._check(name, torch.float32, shape)
    assert problem is not None and "float8_e4m3fn" in problem
    assert updater._check(name, torch.float8_e4m3fn, shape)[0] is None
    assert updater._check(fp8.scale_name(name), torch.float32, fmt.scale_shape(shape))[0] is None
    assert name in updater.checksums() and fp8.scale_name(name) in updater.checksums()


def test_the_learner_reads_the_engines_format_and_refuses_online_quantization(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    from megatron_sao.config import load_config
    from megatron_sao.run.learn import engine_fp8_format

    fmt = fp8.write_checkpoint(tiny_models["qwen3_moe"], tmp_path / "fp8", block=(16, 16))
    base = ["--model.hf_path", str(tiny_models["qwen3_moe"]), "--rollout.engine", "sglang"]
    assert engine_fp8_format(load_config(None, base)) is None  # the engines serve the learner's bf16/fp32 checkpoint
    assert engine_fp8_format(load_config(None, [*base, "--rollout.model_path", str(tmp_path / "fp8")])) == fmt
    online = [*base, "--rollout.sglang.extra_args", '["--quantization", "fp8"]']
    with pytest.raises(ValueError, match="is not a block-FP8 checkpoint"):
        engine_fp8_format(load_config(None, [*online, "--rollout.model_path", str(tiny_models["qwen3_moe"])]))
    with pytest.raises(ValueError, match="rollout.model_path=.* has no config.json"):
        engine_fp8_format(load_config(None, [*base, "--rollout.model_path", str(tmp_path / "missing")]))
