"""What each TP rank of the engine behind a push agent takes, and in which load format (owned by engines/agent/).

Two ways, chosen by what the engine offers (`plan_handover`):
- **direct** -- the engine publishes `/weight_shards` (the embedded engine): rank r takes, under HF names, its block of
  every tensor it holds split and the other tensors whole; `load_format: "direct"` copies them in as they are.
- **hf** -- SGLang (0.5.x): its `load_format: None` is the model's own `load_weights`, which takes full HF tensors,
  slices dense ones itself and skips experts that are not local (FusedMoE's global -> local expert map). So rank r
  takes every dense tensor whole and, of the routed experts `experts.<e>.*`, only those its expert-parallel rank
  stores: with `ep_size` = E, `moe_tp_size = tp_size / E`, rank r stores experts
  `[(r // moe_tp_size) * n, (r // moe_tp_size + 1) * n)`, n = routed experts / E (SGLang's parallel state and
  `FusedMoE._map_global_expert_id_to_local_expert_id`). An expert a rank does not store is a zero-size block.
  `load_weights` also runs the model's own post-load step for what it loaded (DeepSeek/GLM MLA: `w_kc`/`w_vc` of the
  layers whose `kv_b_proj` came), which `end_weight_update` skips after any tensor-route load: so a module's tensors
  (weight and FP8 scale) are handed over in one call (`parts`).
Refused (the agent does not start): an EPLB/redundant-expert placement, where the storage of an expert is not fixed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_sao.config.model import read_hf_config_json
from megatron_sao.distributed import flat_bucket

DIRECT, HF = "direct", "hf"
HANDOVERS = ("auto", DIRECT, HF)
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_EXPERT_COUNT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


class HandoverError(ValueError):
    """The engine behind the agent cannot be handed slices as asked; the message names the setting to change."""


@dataclass(frozen=True)
class Handover:
    """Per engine TP rank, the block of each on-disk tensor it takes (`boxes[name][r]`; None: the tensor whole), and
    the load_format of /update_weights_from_tensor that loads those blocks."""

    mode: str
    tp_size: int
    boxes: dict[str, list[flat_bucket.Box | None]]

    @property
    def load_format(self) -> str | None:
        return "direct" if self.mode == DIRECT else None

    def box(self, name: str, rank: int) -> flat_bucket.Box | None:
        boxes = self.boxes.get(name)
        return None if boxes is None else boxes[rank]

    def weight_shards(self) -> dict[str, Any]:
        """The /weight_shards answer a learner reads (the embedded engine's format)."""
        return {"tp_size": self.tp_size,
                "shards": {n: [None if b is None else [list(b[0]), list(b[1])] for b in bs]
                           for n, bs in self.boxes.items()}}  # fmt: skip


def checkpoint_table(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """{on-disk name: a meta tensor of its shape and dtype} from the checkpoint's safetensors headers (what the
    learner sends: the checkpoint's own dtypes, FP8 weights with their scales)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise HandoverError(f"{model_dir} holds no *.safetensors: give the agent the engine's model directory "
                            "(--model, SGLang's --model-path)")  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                s = st.get_slice(name)
                dtype = flat_bucket.dtype_from_name(_safetensors_dtype(s.get_dtype()))
                out[name] = torch.empty(s.get_shape(), dtype=dtype, device="meta")
    return out


def _safetensors_dtype(code: str) -> str:
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
             "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}  # fmt: skip
    if code not in names:
        raise HandoverError(f"safetensors dtype {code} is not one a push carries")
    return names[code]


def expert_count(model_dir: str | Path) -> int:
    """Routed experts per MoE layer from config.json (0 for a dense model)."""
    cfg = read_hf_config_json(model_dir)
    cfg = cfg.get("text_config", cfg)
    return next((int(cfg[k]) for k in _EXPERT_COUNT_KEYS if cfg.get(k)), 0)


def expert_ranks(info: dict[str, Any], experts: int) -> list[range]:
    """For each TP rank of an SGLang engine (its /server_info), the routed experts it stores."""
    tp = int(info.get("tp_size") or 1)
    ep = int(info.get("ep_size") or 1)
    if int(info.get("ep_num_redundant_experts") or 0) or info.get("enable_eplb") or (
            info.get("init_expert_location") not in (None, "trivial")):  # fmt: skip
        raise HandoverError("the engine places experts by EPLB (--ep-num-redundant-experts / --enable-eplb / "
                            "--init-expert-location): which rank stores an expert moves, so the agent cannot hand "
                            "each rank its experts; run the engine without them or push full tensors "
                            "(weight_sync.agent: false)")  # fmt: skip
    if tp % ep or (experts and experts % ep):
        raise HandoverError(f"the engine's --ep-size {ep} divides neither --tp-size {tp} nor the {experts} experts")
    moe_tp, per = tp // ep, (experts // ep if experts else 0)
    return [range((r // moe_tp) * per, (r // moe_tp + 1) * per) for r in range(tp)]


def plan_handover(mode: str, info: dict[str, Any], table: dict[str, torch.Tensor],
                  shards: dict[str, Any] | None, experts: int) -> Handover:  # fmt: skip
    """The handover to the engine of /server_info `info` (and /weight_shards `shards`, None where it serves none)."""
    tp = int(info.get("tp_size") or 1)
    if mode not in HANDOVERS:
        raise HandoverError(f"--handover={mode!r}: use one of {HANDOVERS}")
    if mode == "auto":
        mode = DIRECT if shards is not None else HF
    if mode == DIRECT:
        if shards is None:
            raise HandoverError("--handover direct: the engine serves no /weight_shards, so its ranks' blocks are "
                                "unknown (SGLang's 'direct' takes its own fused parameters); use --handover "
                                "hf")  # fmt: skip
        if int(shards.get("tp_size", -1)) != tp:
            raise HandoverError(f"/weight_shards is for tp_size {shards.get('tp_size')}, /server_info says {tp}")
        boxes = {n: [None if b is None else (tuple(b[0]), tuple(b[1])) for b in bs]
                 for n, bs in shards["shards"].items()}  # fmt: skip
        return Handover(DIRECT, tp, boxes)
    stores = expert_ranks(info, experts)
    boxes = {}
    for name, meta in table.items():
        m = _EXPERT.search(name)
        if m is None or tp == 1 or all(len(s) == experts for s in stores):
            continue  # dense, or every rank stores every expert: whole to every rank
        e, zero = int(m.group(1)), ((0,) * meta.dim(), (0,) * meta.dim())
        boxes[name] = [None if e in s else zero for s in stores]
    return Handover(HF, tp, boxes)


def parts(sizes: Sequence[Sequence[tuple[str, int]]], limit_bytes: int) -> list[list[list[str]]]:
    """Split every rank's tensors (name, bytes), in order, into the same number of handover calls of about
    `limit_bytes` per rank; a module's tensors (a weight and its scale) stay in one call. parts[i][r]: the names
    rank r hands over in call i (possibly none)."""
    grouped = [_modules(sorted(rank, key=lambda x: x[0].rsplit(".", 1)[0])) for rank in sizes]
    totals = [sum(b for _, b in rank) for rank in sizes]
    n = max(1, *(math.ceil(t / max(limit_bytes, 1)) for t in totals))
    out: list[list[list[str]]] = [[[] for _ in sizes] for _ in range(n)]
    for r, modules in enumerate(grouped):
        share, filled, i = max(totals[r] / n, 1), 0, 0
        for names, nbytes in modules:
            if filled >= share * (i + 1) and i < n - 1:
                i += 1
            out[i][r].extend(names)
            filled += nbytes
    return out


def _modules(named: Sequence[tuple[str, int]]) -> list[tuple[list[str], int]]:
    """Consecutive tensors of one module (the name up to its last dot) as one unit: (names, bytes); `named` is
    sorted by module."""
    out: list[tuple[list[str], int]] = []
    prefix = None
    for name, nbytes in named:
        p = name.rsplit(".", 1)[0]
        if out and p == prefix:
            out[-1][0].append(name)
            out[-1] = (out[-1][0], out[-1][1] + nbytes)
        else:
            out.append(([name], nbytes))
        prefix = p
    return out
