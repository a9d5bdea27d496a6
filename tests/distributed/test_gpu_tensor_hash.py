"""SGLang hashes the weights of an engine on GPUs with its own Triton kernel (kernels/ops/memory/gpu_tensor_hash.py),
not sha256; flat_bucket.gpu_tensor_hash ports it. Proven two ways: the kernel itself, read from the pinned SGLang
wheel and run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, its two `is_cuda` asserts lifted, in a
subprocess with triton installed beside the suite by sglang_source.triton_path), against the port on the same
tensors; and values recorded from that kernel run, checked without the kernel too."""

from __future__ import annotations

import pytest
import torch

from megatron_sao.distributed import flat_bucket
from tests.engines.sglang_source import run_kernel


def _cases() -> dict[str, torch.Tensor]:
    """Tensors whose bytes do not depend on a random generator: dtypes SGLang engines hold (bf16, fp32, fp8 e4m3),
    byte counts that are not whole words, one and several kernel tiles (8,192 words), and nothing at all."""
    wave = (torch.arange(3 * 8193 + 5, dtype=torch.float64) * 0.37).sin()
    return {
        "fp32 x10": torch.arange(10, dtype=torch.float32),
        "bf16 x7 (14 bytes)": torch.arange(7, dtype=torch.bfloat16),
        "fp32 x20000 (3 tiles)": torch.arange(20000, dtype=torch.float32),
        "bf16 x24584 (odd words, 2 tiles)": wave.to(torch.bfloat16),
        "fp8 e4m3 x1001": torch.linspace(-3, 3, 1001).to(torch.float8_e4m3fn),
        "uint8 x3": torch.tensor([3, 1, 4], dtype=torch.uint8),
        "fp32 2x3 transposed": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),
        "empty": torch.zeros(0),
    }


RECORDED = {  # from SGLang 0.5.23's kernel under Triton's interpreter (test_the_port_equals_sglangs_kernel)
    "fp32 x10": 0x3015603431603089,
    "bf16 x7 (14 bytes)": 0x6ACD222320AFB5C2,
    "fp32 x20000 (3 tiles)": 0x2C83F6B96FB4C653,
    "bf16 x24584 (odd words, 2 tiles)": 0x7F72CA30FF4A7D6F,
    "fp8 e4m3 x1001": 0x002681CA102969B4,
    "uint8 x3": 0x21128A236203929D,
    "fp32 2x3 transposed": 0x851BA375603CF6D0,
    "empty": 0,
}


def _sglang_kernel_hashes(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """SGLang's gpu_tensor_hash of each tensor: the wheel's kernel module under Triton's interpreter (a subprocess)."""
    lift = ('assert t.is_cuda, "Use .cuda() first"', 'assert tensor.is_cuda, "Use .cuda() first"')
    return run_kernel("kernels/ops/memory/gpu_tensor_hash.py", "gpu_tensor_hash(x)", tensors, lift)


def test_the_port_equals_the_recorded_kernel_values():
    for name, tensor in _cases().items():
        assert flat_bucket.gpu_tensor_hash(tensor) == RECORDED[name], name
    assert flat_bucket.gpu_tensor_checksum(_cases()["fp8 e4m3 x1001"]) == "002681ca102969b4"


@pytest.mark.multiproc
def test_the_port_equals_sglangs_kernel(monkeypatch: pytest.MonkeyPatch):
    cases = _cases()
    kernel = _sglang_kernel_hashes(cases)
    for name, tensor in cases.items():
        assert kernel[name] == RECORDED[name] == flat_bucket.gpu_tensor_hash(tensor), name
    # the port hashes long tensors in chunks of tiles: the same value when every tile is a chunk of its own
    monkeypatch.setattr(flat_bucket, "_CHUNK_TILES", 1)
    for name in ("fp32 x20000 (3 tiles)", "bf16 x24584 (odd words, 2 tiles)"):
        assert flat_bucket.gpu_tensor_hash(cases[name]) == RECORDED[name], name


def test_the_gpu_hash_is_not_sglangs_cpu_hash_and_sees_every_byte():
    t = torch.arange(10, dtype=torch.float32)
    assert flat_bucket.gpu_tensor_checksum(t) != flat_bucket.tensor_checksum(t)
    flipped = t.clone()
    flipped.view(torch.uint8)[17] ^= 1
    assert flat_bucket.gpu_tensor_hash(flipped) != flat_bucket.gpu_tensor_hash(t)
    # like the kernel, the hash covers the bytes padded with zeros to whole words: a trailing zero byte that only
    # completes a word is not seen (the kernel's own rule)
    three = torch.tensor([3, 1, 4], dtype=torch.uint8)
    four = torch.tensor([3, 1, 4, 0], dtype=torch.uint8)
    assert flat_bucket.gpu_tensor_hash(three) == flat_bucket.gpu_tensor_hash(four)
