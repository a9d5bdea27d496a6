"""Block-wise FP8 weights, the checkpoint format SGLang loads for DeepSeek-V3-, GLM- and Qwen3-FP8-style models (owned
by models/; used by weight_sync/ to quantize pushes into the engines' format and by engines/embedded/ to serve such a
checkpoint).

Format: config.json carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [bn, bk]}`; each quantized linear weight `X.weight` [N, K] is stored as
float8_e4m3fn, beside `X.weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)], one scale per block:
W = q * scale_inv over each block. Which weights are quantized is the checkpoint's own choice (the names that have a
`_scale_inv` companion); norms, embeddings, the output layer and the routers stay in their dtype.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_sao.config.model import read_hf_config_json

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@dataclass(frozen=True)
class Fp8Format:
    """The block-FP8 layout of a checkpoint: its block size and the HF names of the weights it stores in FP8."""

    block: tuple[int, int]
    names: frozenset[str]

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return (math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1]))

    def quantized(self, name: str) -> bool:
        return name in self.names


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """One scale per element: each block's scale repeated over the block (cut at the tensor's edge)."""
    return scale.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv per block) of a 2-D weight: each block scaled so its largest
    magnitude maps to FP8's largest (448)."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {list(weight.shape)}")
    w = weight.float()
    n, k = w.shape
    rows, cols = math.ceil(n / block[0]), math.ceil(k / block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=w.device)
    padded[:n, :k] = w
    amax = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    shape = (int(q.shape[0]), int(q.shape[1]))
    return (q.float() * _expand(scale.float(), shape, block)).to(dtype)


def checkpoint_format(model_dir: str | Path) -> Fp8Format | None:
    """The block-FP8 format of an HF checkpoint directory, or None when it is not one. ValueError for an FP8
    quantization_config this project cannot feed (not block-wise, or not e4m3)."""
    path = Path(model_dir)
    config = read_hf_config_json(path)
    quant = config.get("quantization_config")
    if not quant or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not block or len(block) != 2 or quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{path}/config.json: quantization_config {quant} is not block-wise e4m3 FP8 (need "
                         "weight_block_size [bn, bk]); per-tensor FP8 cannot take weight pushes")  # fmt: skip
    names = frozenset(n.removesuffix(SCALE_SUFFIX) for n in checkpoint_names(path) if n.endswith(SCALE_SUFFIX))
    return Fp8Format((int(block[0]), int(block[1])), names)


def checkpoint_names(model_dir: Path) -> list[str]:
    """Every tensor name of a safetensors checkpoint (headers only)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names.extend(sf.keys())
    return sorted(names)


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The weights an FP8 release quantizes: the linear projections (attention, MLP, experts); not norms, embeddings,
    the output layer or the routers."""
    return tensor.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def write_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Fp8Format:
    """Write `src` (an HF checkpoint) as a block-FP8 one at `dst` (config, tokenizer and other files copied)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if quantizable(name, t):
                out[name], out[scale_name(name)] = quantize(t, block)
            else:
                out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config = read_hf_config_json(dst)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    fmt = checkpoint_format(dst)
    assert fmt is not None
    return fmt


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_sao.models.fp8 SRC DST [--block 128 128]`: write an HF checkpoint as block-FP8."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megatron_sao.models.fp8", description=main.__doc__)
    parser.add_argument("src", help="an HF checkpoint directory (bf16 or fp32)")
    parser.add_argument("dst", help="where to write the block-FP8 checkpoint")
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"))
    args = parser.parse_args(argv)
    if not (Path(args.src) / "config.json").is_file():
        parser.error(f"{args.src} has no config.json: pass an HF checkpoint directory")
    fmt = write_checkpoint(args.src, args.dst, (args.block[0], args.block[1]))
    print(f"wrote {args.dst}: {len(fmt.names)} weights in FP8, blocks {fmt.block[0]}x{fmt.block[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
