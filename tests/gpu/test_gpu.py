"""The GPU tier (`./tests/run.sh --gpu`; `benchmarks/gpu_check.sh` runs it on a lent GPU): what must hold on CUDA that
the CPU tiers cannot show. Every test here skips, naming what is missing, where its device or package is absent, so
the tier reports its tests skipped with their reasons on a CPU machine instead of collecting nothing.

- the policy on a CUDA device gives transformers' log-probs (fp32, local spec): the platform layer's device choice,
  megatron's CUDA kernels and the packed micro-batches moved to the device;
- Transformer Engine layer specs (THD-packed, bf16) give what the local spec gives on the same weights;
- an update group on NCCL, built the way SGLang builds its own, broadcasts and is aborted without ending the process;
- an NCCL weight push between two processes (sender on one GPU, receiver on another) lands every tensor bit for bit;
- a bf16 learner on the GPU pushes to an embedded engine (gathers and packing on the device, pinned host send
  buffer), and the engine's checksums equal what was sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_sao.distributed import spawn_ranks
from megatron_sao.distributed.spawn import find_free_port
from tests.learner.test_forward_parity import _hf_logprobs  # transformers on the CPU: the reference

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc]

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; the CPU tiers test these paths on gloo"
)


def _te_missing() -> str | None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a TE build that does not load against this torch
        return f"Transformer Engine does not import ({type(e).__name__}): pip install -e '.[gpu]'"
    return None


def _policy_logprobs(hf_dir: str, dtype: str, use_te: bool, temperature: float) -> dict[str, Any]:
    """One rank: the policy built on this rank's device from `hf_dir`; its log-probs of the synthetic batch."""
    from megatron_sao.config import ParallelConfig
    from megatron_sao.distributed import destroy_distributed, init_distributed
    from megatron_sao.learner.batch import make_step_batch
    from megatron_sao.learner.forward import collect_logprobs
    from megatron_sao.learner.packing import pack_microbatches
    from megatron_sao.learner.synthetic import make_batch
    from megatron_sao.models.builder import ModelSpec, build_model, transformer_config
    from megatron_sao.models.weights import HFCheckpoint, load_hf_weights

    ctx = init_distributed(ParallelConfig(), seed=3)
    spec = ModelSpec.from_hf_dir(hf_dir, dtype=dtype)
    policy = build_model(spec, transformer_config(spec, ParallelConfig(), use_te=use_te), use_te=use_te)
    if ctx.device.type == "cuda":  # as learner/roles.py does: torch's norms are made on the CPU
        policy.cuda(ctx.device)
    load_hf_weights(policy, spec, HFCheckpoint(hf_dir))
    batch = make_step_batch(make_batch(5), max_seq_len=4096)
    mbs = pack_microbatches(batch, max_tokens=64, pad_multiple=1, use_thd=use_te)
    logp = torch.zeros_like(batch.rollout_logprobs)
    with torch.no_grad():
        assert collect_logprobs(
            policy, mbs, logp, temperature=temperature, vocab_size=spec.vocab_size, tp_rank=ctx.tp_rank
        )
    device = str(next(policy.parameters()).device)
    destroy_distributed()
    return {"logp": logp, "mask": batch.action_mask, "device": device, "context_device": str(ctx.device)}


@needs_cuda
def test_the_policy_on_cuda_gives_transformers_logprobs(tiny_hf_dir: Any) -> None:
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    out = spawn_ranks(_policy_logprobs, 1, hf_dir, "fp32", False, 0.7, timeout_s=600)[0]
    assert out["device"].startswith("cuda") and out["context_device"].startswith("cuda"), out["device"]
    ref = _hf_logprobs(hf_dir, 0.7)
    mask = out["mask"].bool()
    diff = (out["logp"] - ref)[mask].abs()
    # fp32 on both sides; cuBLAS and the CPU sum in other orders (and TF32 is off by default for matmuls)
    assert diff.max().item() < 2e-3, diff.max().item()


@needs_cuda
@pytest.mark.skipif(_te_missing() is not None, reason=_te_missing() or "")
def test_transformer_engine_specs_give_what_the_local_spec_gives(tiny_hf_dir: Any) -> None:
    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    te = spawn_ranks(_policy_logprobs, 1, hf_dir, "bf16", True, 1.0, timeout_s=600)[0]
    local = spawn_ranks(_policy_logprobs, 1, hf_dir, "bf16", False, 1.0, timeout_s=600)[0]
    mask = te["mask"].bool()
    diff = (te["logp"] - local["logp"])[mask].abs()
    # bf16 activations through different kernels (TE's fused attention on THD vs the local block-causal mask)
    assert diff.mean().item() < 0.02 and diff.max().item() < 0.25, (diff.mean().item(), diff.max().item())


def _nccl_group_broadcast_and_abort() -> dict[str, Any]:
    import torch.distributed as dist

    from megatron_sao.distributed.update_group import abort_update_group, host_store, init_update_group

    store, port = host_store("127.0.0.1", find_free_port(), 1, 60.0)
    group = init_update_group("nccl", "127.0.0.1", port, 1, 0, "gpu-tier", 60.0, store=store)
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    dist.broadcast(x, src=0, group=group)
    torch.cuda.synchronize()
    backend = dist.get_backend(group)
    abort_update_group(group)
    return {"last": float(x[-1].item()), "backend": backend, "alive_after_abort": True}


@needs_cuda
def test_an_nccl_update_group_broadcasts_and_aborts_without_ending_the_process() -> None:
    out = spawn_ranks(_nccl_group_broadcast_and_abort, 1, timeout_s=300)[0]
    assert out == {"last": float((1 << 20) - 1), "backend": "nccl", "alive_after_abort": True}


def _nccl_push_end(rank: int, port: int, names: list[str], shapes: list[list[int]]) -> dict[str, str]:
    """Rank 0 packs a bucket of seeded bf16/fp32 tensors on cuda:0 and broadcasts it; rank 1 receives on cuda:1 and
    unpacks it: both return {name: checksum} of the tensors as they hold them."""
    import torch.distributed as dist

    from megatron_sao.distributed import flat_bucket
    from megatron_sao.distributed.update_group import destroy_update_group, init_update_group

    torch.cuda.set_device(rank)
    dtypes = [torch.float32 if "bias" in n else torch.bfloat16 for n in names]
    order = flat_bucket.aligned_order(list(range(len(names))), lambda i: dtypes[i])
    slots = flat_bucket.layout([names[i] for i in order], [dtypes[i] for i in order], [shapes[i] for i in order])
    buffer = torch.empty(flat_bucket.nbytes(slots), dtype=torch.uint8, device="cuda")
    if rank == 0:
        g = torch.Generator(device="cuda").manual_seed(7)
        for s in slots:
            flat_bucket.view(buffer, s).copy_(torch.randn(s.shape, generator=g, device="cuda").to(s.dtype))
    group = init_update_group("nccl", "127.0.0.1", port, 2, rank, "gpu-tier-push", 120.0)
    dist.broadcast(buffer, src=0, group=group)
    torch.cuda.synchronize()
    destroy_update_group(group)
    return {s.name: flat_bucket.tensor_checksum(flat_bucket.view(buffer, s)) for s in slots}


def _nccl_push(port: int, names: list[str], shapes: list[list[int]]) -> dict[str, str]:
    return _nccl_push_end(int(os.environ["RANK"]), port, names, shapes)


@needs_cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="an NCCL push between two processes needs two GPUs (NCCL refuses two ranks on one device)",
)
def test_an_nccl_weight_push_between_two_processes_lands_bit_for_bit() -> None:  # fmt: skip
    names = ["layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.router.expert_bias", "layers.0.norm.weight"]
    shapes = [[8, 256, 128], [8], [127]]  # an odd bf16 tensor after the fp32 one: the aligned order handles it
    sender, receiver = spawn_ranks(_nccl_push, 2, find_free_port(), names, shapes, timeout_s=300)
    assert sender == receiver and set(sender) == set(names)


def _device_push(hf_dir: str, url: str, master_port: int) -> dict[str, Any]:
    """A bf16 policy on this rank's GPU pushes a changed copy of its weights to the engine at `url` (gloo update
    group; gathers and packing on the device), verified by the engine's checksums."""
    from megatron_sao.config import load_config
    from megatron_sao.distributed import init_distributed
    from megatron_sao.engines.client import SGLangClient
    from megatron_sao.learner.learner import Learner
    from megatron_sao.weight_sync import WeightSync, hf_dtype_of

    cfg = load_config(None, ["--model.hf_path", hf_dir, "--model.dtype", "bf16", "--weight_sync.backend", "gloo",
                             "--weight_sync.verify", "checksum", "--weight_sync.bucket_mb", "1",
                             "--weight_sync.master_port", str(master_port)])  # fmt: skip
    learner = Learner(cfg, roles={"policy"}, layout=init_distributed(cfg.parallel))
    learner.load_hf(hf_dir)
    sync = WeightSync(learner.policy.model, learner.spec, hf_dtype_of(learner.hf_source, torch.bfloat16),
                      cfg.weight_sync, [url], layout=learner.layout)  # fmt: skip
    with torch.no_grad():
        for p in learner.policy.model.parameters():
            p.add_(0.01)
    t0 = time.monotonic()
    metrics = sync.push(1)
    seconds = time.monotonic() - t0
    out = {"metrics": metrics, "version": SGLangClient(url).weight_version(), "seconds": seconds,
           "gather_device": str(sync.gather.device), "send_device": str(sync.gather.send_device)}  # fmt: skip
    sync.close()
    return out


@needs_cuda
def test_a_learner_on_the_gpu_pushes_to_an_embedded_engine_and_the_checksums_agree(tiny_hf_dir: Any) -> None:
    from megatron_sao.engines.client import SGLangClient

    hf_dir = str(tiny_hf_dir("qwen3_moe"))
    port = find_free_port()
    log_path = Path(tempfile.mkdtemp(prefix="gpu-tier-engine-")) / "engine.log"
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}  # the embedded engine runs on the CPU
    with open(log_path, "wb") as log:
        engine = subprocess.Popen([sys.executable, "-m", "megatron_sao", "engine", "--model", hf_dir, "--port",
                                   str(port)], stdout=log, stderr=subprocess.STDOUT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        client = SGLangClient(url)
        deadline = time.monotonic() + 300
        while not client.health(timeout_s=1.0):
            assert engine.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        out = spawn_ranks(_device_push, 1, hf_dir, url, find_free_port(), timeout_s=600)[0]
    finally:
        engine.kill()
        engine.wait()
    print({k: v for k, v in out.items() if k != "metrics"}, {k: v for k, v in out["metrics"].items()
                                                              if k.startswith("sync/")})  # fmt: skip
    assert out["metrics"]["sync/failed"] == 0 and out["version"] == 1, out
    assert out["gather_device"].startswith("cuda"), out


# ---- SGLang's tensor hash on CUDA -----------------------------------------------------------------------------------
def _sglang_wheel_missing() -> str | None:
    from tests.engines.sglang_source import CACHE, PINNED

    if os.environ.get("SAO_SGLANG_WHEEL") or list(CACHE.glob(f"sglang-{PINNED}-*.whl")):
        return None
    return (f"no sglang {PINNED} wheel here (carry it: SAO_SGLANG_WHEEL=<path>; the CPU tier fetches it into "
            f"{CACHE})")  # fmt: skip


@needs_cuda
def test_the_gpu_hash_port_equals_sglangs_kernel_on_cuda() -> None:
    """flat_bucket.gpu_tensor_hash (what the learner compares SGLang's /weights_checker with) equals SGLang's own
    Triton kernel run on CUDA, the way SGLang's weight checker runs it (the CPU tier compares the kernel under
    Triton's interpreter)."""
    pytest.importorskip("triton", reason="CUDA torch ships triton; this torch has none")
    if (why := _sglang_wheel_missing()) is not None:
        pytest.skip(why)
    from megatron_sao.distributed import flat_bucket
    from tests.distributed.test_gpu_tensor_hash import RECORDED, _cases
    from tests.engines.sglang_source import source

    ns: dict[str, Any] = {"__name__": "sglang_gpu_tensor_hash"}
    exec(compile(source("kernels/ops/memory/gpu_tensor_hash.py"), "gpu_tensor_hash.py", "exec"), ns)
    big = torch.randn(3, 1 << 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # 384 tiles
    for name, tensor in {**_cases(), "bf16 3x2^20 random": big}.items():
        if tensor.numel() == 0:
            continue  # the kernel's wrapper returns 0 before any launch
        on_gpu = ns["gpu_tensor_hash"](tensor.cuda())
        assert on_gpu == flat_bucket.gpu_tensor_hash(tensor), name
        assert name not in RECORDED or on_gpu == RECORDED[name], name


_OPEN_AS_SGLANG = """
import json, sys, torch
from megatron_sao.distributed import flat_bucket, tensor_payload
torch.cuda.set_device(0)
pairs = tensor_payload.named_tensors(tensor_payload.open_entry(open(sys.argv[1]).read()), None)
# SGLang's TP worker: each tensor to its device (_unwrap_tensor), then loaded; here: what arrived, hashed
print(json.dumps({n: flat_bucket.tensor_checksum(t.to("cuda").cpu()) for n, t in pairs}), flush=True)
assert all(t.is_cuda for _, t in pairs), [t.device for _, t in pairs]
"""


@needs_cuda
def test_the_agents_cuda_ipc_handover_opens_in_another_process(tmp_path: Path) -> None:
    """The push agent's handover on a GPU (engines/agent/ranks.py lend): a rank's part copied to the device and packed
    as CUDA IPC handles opens in another process under SGLang's safe unpickler, as SGLang's TP worker opens it, and
    holds exactly what the agent received (its block cut from a tensor that came whole)."""
    from megatron_sao.distributed import flat_bucket
    from megatron_sao.engines.agent.handover import Handover
    from megatron_sao.engines.agent.ranks import AgentReceiver
    from megatron_sao.engines.embedded.weights import ReceivedUpdate
    from megatron_sao.engines.protocol import ServerProtocol
    from megatron_sao.models.mapping import Target

    host = {"a.weight": torch.randn(64, 32).to(torch.bfloat16), "b.weight": torch.randn(1001)}
    if hasattr(torch, "float8_e4m3fn"):
        host["c.weight"] = torch.randn(16, 16).to(torch.float8_e4m3fn)
    table = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in host.items()}
    handover = Handover("direct", 1, {"a.weight": [((32, 0), (32, 32))]})
    receiver = AgentReceiver(table, ServerProtocol("0.5.23", agent=True), handover, 0, torch.device("cuda", 0), 60.0)
    receiver.pending = ReceivedUpdate([Target(n) for n in host], list(host.values()), "1")
    entry = receiver.lend([list(host)])
    (tmp_path / "entry").write_text(entry)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", _OPEN_AS_SGLANG, str(tmp_path / "entry")], capture_output=True,
                         text=True, timeout=120, env=env)  # fmt: skip
    receiver.returned()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    want = {n: flat_bucket.tensor_checksum(t) for n, t in host.items()}
    want["a.weight"] = flat_bucket.tensor_checksum(host["a.weight"][32:].contiguous())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == want
