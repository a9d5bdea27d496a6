"""The embedded engine's model: loading an HF checkpoint, batched forward passes over the slot KV cache, sampling
and per-token log-probs (owned by embedded/; called only by embedded/scheduler.py).

Log-prob semantics (the same as SGLang's default sampler, layers/sampler.py in 0.5.23): for a sampled request the
reported log-prob of token t is `log_softmax(logits / temperature)[t]`, i.e. under the temperature-scaled
distribution **before** top-k / top-p / min-p truncation; for a greedy request (temperature < 1e-5) it is
`log_softmax(logits)[t]` of the unscaled logits. The learner recomputes `logp_theta` at the same temperature.
"""

from __future__ import annotations

import functools
import inspect
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_sao.models import fp8

GREEDY_EPS = 1e-5  # SGLang's _SAMPLING_EPS: temperatures below it mean greedy


@dataclass
class SamplingParams:
    """The subset of SGLang's sampling_params the embedded engine honours (see protocol.SAMPLING_PARAM_FIELDS)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def check_safetensors(path: Path) -> None:
    """Open every safetensors file's header (cheap; it checks the file is as long as the header says), so a
    truncated or damaged shard is named before transformers fails on it with a message naming none."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:
            raise ValueError(f"{f} is not a readable safetensors file ({e}): truncated or damaged? re-download or "
                             "re-convert it") from None  # fmt: skip


# SGLang at --tp-size N (no --ep-size) cuts every routed expert's intermediate dimension over the N ranks. transformers'
# MoE families said the same in their tensor-parallel plans up to 5.24; from 5.25 their plans leave the experts out (the
# moe_tp_experts style is deprecated in favour of expert parallelism, removal in 5.28), which replicates every expert on
# every rank. The engine names the rules itself, so its ranks hold what SGLang's do whichever release is installed.
EXPERT_TP_RULES = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",  # fused [E, 2I, H]: each rank its half of gate and of up
    "layers.*.mlp.experts.down_proj": "rowwise",  # [E, H, I]: each rank its part of I
    "layers.*.mlp.experts": "moe_tp_experts",  # partial outputs summed over the ranks
}


def tp_plan_of(config: Any) -> dict[str, str] | str:
    """The tensor-parallel plan the engine loads with: the model type's own plan ("auto"), with EXPERT_TP_RULES
    (under the model's prefix) added for a model with routed experts whose plan leaves them out. An installed
    transformers without the moe_tp_experts style (5.28 on) is refused, naming the pin, rather than served with every
    expert replicated."""
    plan = config.base_model_tp_plan
    routed = any(getattr(config, k, None) for k in ("num_experts", "n_routed_experts", "num_local_experts"))
    if not routed or any(k.startswith("layers.*.mlp.experts") for k in plan):
        return "auto"
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    if "moe_tp_experts" not in ALL_PARALLEL_STYLES:
        import transformers

        raise ValueError(f"transformers {transformers.__version__} has no moe_tp_experts tensor-parallel style, so the "
                         "embedded engine cannot cut its experts over --tp-size ranks as SGLang does; install "
                         "transformers<5.28 (pyproject.toml pins it) or serve at --tp-size 1")  # fmt: skip
    return {f"model.{k}": v for k, v in EXPERT_TP_RULES.items()}


def load_hf_model(model_dir: str | Path, dtype: str = "auto") -> torch.nn.Module:
    """AutoModelForCausalLM from a local directory, eval mode, no grad. dtype: auto | float32 | bfloat16."""
    return load_engine_model(model_dir, dtype)[0]


def load_engine_model(
    model_dir: str | Path, dtype: str = "auto", tp_size: int = 1
) -> tuple[torch.nn.Module, Fp8Weights | None]:
    """(the model, its FP8 weights when the checkpoint is block-FP8 (models/fp8.py) -- served as SGLang serves
    one: the FP8 bytes and scales are what the engine holds and what pushes must bring; the forward runs on their
    dequantization in the compute dtype, float32 for `auto`). `tp_size` > 1: this process is one of the engine's TP
    ranks, all in torch.distributed's default group (embedded/tp.py); the model is sharded over them by its family's
    own tensor-parallel plan in transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; pass an HF model directory (tools/make_tiny_model.py makes one)")
    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype={dtype!r}; use auto, float32 or bfloat16")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} holds config.json but no weights (*.safetensors): copy the model's shards there, or "
                         "convert a trained checkpoint (tools/convert_megatron_to_hf.py)")  # fmt: skip
    check_safetensors(path)
    fmt = fp8.checkpoint_format(path)
    if tp_size > 1:
        from transformers.distributed import DistributedConfig

        if fmt is not None:
            raise ValueError(f"{path} is a block-FP8 checkpoint: the embedded engine serves FP8 at --tp-size 1 only "
                             "(serve the bf16/fp32 checkpoint at TP > 1, or FP8 on one rank)")  # fmt: skip
        config = AutoConfig.from_pretrained(path)
        if not getattr(config, "base_model_tp_plan", None):
            raise ValueError(f"{path}: transformers has no tensor-parallel plan for model_type "
                             f"{getattr(config, 'model_type', None)!r}; serve it at --tp-size 1")  # fmt: skip
        tp = DistributedConfig(tp_size=tp_size, tp_plan=tp_plan_of(config))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*moe_tp_experts.*deprecated")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, distributed_config=tp)
        served = None
    elif fmt is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        except RuntimeError as e:  # transformers' size-mismatch report names neither config.json nor a field
            if "mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
                raise
            with torch.device("meta"):
                described = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
            check_weights_fit_config(path, described)
            raise
        served = None
    else:  # transformers' FP8 loader needs a GPU: build the model and load the checkpoint through the mapping
        config = AutoConfig.from_pretrained(path)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        compute = torch.float32 if torch_dtype == "auto" else torch_dtype
        model = AutoModelForCausalLM.from_config(config, dtype=compute)
        served = Fp8Weights.load(model, path, fmt)
    model.eval()
    model.requires_grad_(False)
    if tp_size == 1 and fmt is None:
        check_weights_fit_config(path, model)
    return model, served


def check_weights_fit_config(path: Path, model: torch.nn.Module) -> None:
    """ValueError naming config.json when the checkpoint's tensors are not the model config.json describes: a shape
    that differs, or a fused expert tensor some of whose experts no file holds (config.json's num_experts above the
    checkpoint's). transformers loads such a pair without a word and leaves the rest at its random init."""
    import re

    from safetensors import safe_open

    from megatron_sao.models.mapping import resolve_in_memory

    tensors = dict(model.state_dict())
    problems: list[str] = []
    experts: dict[str, set[int]] = {}
    # what transformers itself skips on load (e.g. GLM / DeepSeek MTP layers; old rotary buffers)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    index = path / "model.safetensors.index.json"
    files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
        else sorted(path.glob("*.safetensors"))  # fmt: skip
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is no dict
                if name.endswith("rotary_emb.inv_freq") or any(p.search(name) for p in ignored):
                    continue
                shape = tuple(st.get_slice(name).get_shape())
                try:
                    target = resolve_in_memory(name, tensors)
                except KeyError:
                    problems.append(f"{name} {list(shape)} is no weight of the model config.json describes")
                    continue
                held = tuple(target.view(tensors).shape)
                if held != shape:
                    problems.append(f"{name}: {list(shape)} on disk, {list(held)} by config.json")
                if target.expert is not None:
                    experts.setdefault(target.key, set()).add(target.expert)
    for key, seen in experts.items():
        if len(seen) != tensors[key].shape[0]:
            problems.append(f"{key}: config.json gives {tensors[key].shape[0]} experts, the checkpoint holds "
                            f"{len(seen)}")  # fmt: skip
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        listed = "; ".join(problems[:3])
        raise ValueError(f"{path}/config.json does not describe the weights in {path}: {listed}{more}. "
                         "Fix config.json (num_experts, hidden and intermediate sizes, layers) to match the "
                         "checkpoint, or point at the checkpoint it belongs to")  # fmt: skip


class Fp8Weights:
    """A block-FP8 checkpoint as the embedded engine serves it: `tensors` holds, under their HF names, every
    quantized weight's float8_e4m3fn bytes and its `_scale_inv` (what /weights_checker hashes and pushes replace);
    the model's own parameters hold their dequantization, refreshed after every applied update."""

    def __init__(self, model: torch.nn.Module, fmt: fp8.Fp8Format, tensors: dict[str, torch.Tensor]) -> None:
        self.fmt, self.tensors = fmt, tensors
        self._model_tensors = dict(model.state_dict())

    @classmethod
    def load(cls, model: torch.nn.Module, path: Path, fmt: fp8.Fp8Format) -> Fp8Weights:
        from safetensors.torch import load_file

        from megatron_sao.models.mapping import resolve_in_memory

        state = dict(model.state_dict())
        on_disk: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            on_disk.update(load_file(str(f)))
        held: dict[str, torch.Tensor] = {}
        for name, t in on_disk.items():
            if name.endswith(fp8.SCALE_SUFFIX):
                continue
            if fmt.quantized(name):
                held[name], held[fp8.scale_name(name)] = t, on_disk[fp8.scale_name(name)].float()
            else:
                resolve_in_memory(name, state).view(state).copy_(t)
        weights = cls(model, fmt, held)
        weights.refresh(set(fmt.names))
        if getattr(model.config, "tie_word_embeddings", False):
            model.tie_weights()
        return weights

    def refresh(self, names: set[str]) -> None:
        """Dequantize the FP8 weights among `names` (a weight or its scale) into the model's parameters."""
        from megatron_sao.models.mapping import resolve_in_memory

        bases = {n.removesuffix(fp8.SCALE_SUFFIX) for n in names} & set(self.fmt.names)
        with torch.no_grad():
            for base in sorted(bases):
                view = resolve_in_memory(base, self._model_tensors).view(self._model_tensors)
                q, scale = self.tensors[base], self.tensors[fp8.scale_name(base)]
                view.copy_(fp8.dequantize(q, scale, self.fmt.block, view.dtype))


def eos_token_ids(model_dir: str | Path, model: torch.nn.Module) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list)."""
    eos = None
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def build_mask(starts: list[int], q_len: int, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask [B, 1, q_len, kv_len]: query i of row b sees keys j <= starts[b] + i (0), else finfo.min.

    It hides both the future (causality) and the padding of rows shorter than kv_len in the gathered slot cache.
    """
    starts_t = torch.tensor(starts, dtype=torch.long).view(-1, 1, 1)
    q_pos = torch.arange(q_len).view(1, -1, 1) + starts_t  # [B, q, 1]
    k_pos = torch.arange(kv_len).view(1, 1, -1)  # [1, 1, kv]
    visible = k_pos <= q_pos  # [B, q, kv]
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


class RouteCapture:
    """SGLang's `--enable-return-routed-experts` in the embedded engine: a forward hook on every MoE layer's router
    (`model.layers[i].mlp.gate`; transformers' routers return (logits, top-k weights, top-k ids)) records the top-k
    expert ids of each token of a forward. `take(b, q)` hands them over as int32 [b, q, num_hidden_layers, top_k],
    zeros on layers without a router (what SGLang's capture buffer holds there)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        self.num_layers = int(cfg.num_hidden_layers)
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self._seen: dict[int, torch.Tensor] = {}
        hooked = 0
        for i, layer in enumerate(model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and getattr(gate, "top_k", None) == self.top_k:
                gate.register_forward_hook(functools.partial(self._record, i))
                hooked += 1
        if not hooked:
            raise ValueError(f"--enable-return-routed-experts: {type(model).__name__} has no MoE router to capture "
                             "(a dense model routes nothing; serve it without the flag)")  # fmt: skip

    def _record(self, layer: int, _module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        self._seen[layer] = output[2].detach()

    def take(self, b: int, q: int) -> torch.Tensor:
        out = torch.zeros(b * q, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, ids in self._seen.items():
            out[:, layer] = ids.reshape(b * q, self.top_k)
        self._seen.clear()
        return out.view(b, q, self.num_layers, self.top_k)


class ModelRunner:
    """Runs forward passes of one HF causal LM over a SlotKVCache."""

    def __init__(
        self,
        model: torch.nn.Module,
        mirror: Callable[[list[int], list[int], torch.Tensor], None] | None = None,
        capture_routes: bool = False,
    ) -> None:
        self.model = model
        self.mirror = mirror  # at --tp-size > 1: hands the forward to the other ranks first (embedded/tp.py)
        self.routes = RouteCapture(model) if capture_routes else None
        self.last_routes: torch.Tensor | None = None  # int32 [B, q, layers, top_k] of the last forward (capture on)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.config.vocab_size)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def forward(self, cache, slots: list[int], starts: list[int], input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, q] (row b continues slot slots[b] at position starts[b]) -> last logits [B, V] fp32."""
        b, q = input_ids.shape
        kv_len = cache.begin(slots, starts, q)  # a sequence past the context is refused here, before any rank runs
        if self.mirror is not None:
            self.mirror(slots, starts, input_ids)
        position_ids = torch.arange(q).view(1, -1) + torch.tensor(starts, dtype=torch.long).view(-1, 1)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=build_mask(starts, q, kv_len, self.dtype),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        if self.routes is not None:
            self.last_routes = self.routes.take(b, q)
        return out.logits[:, -1, :].float()


def _truncate(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Zero the probabilities outside top-k / top-p / min-p (probs [V], already temperature-scaled)."""
    if 0 < p.top_k < probs.shape[-1]:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep_sorted = (torch.cumsum(sorted_p, 0) - sorted_p) < p.top_p  # always keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    if p.min_p > 0.0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float]]:
    """logits [B, V] fp32 -> (token ids [B], log-probs [B]) with the semantics in the module docstring."""
    tokens: list[int] = []
    logprobs: list[float] = []
    for row, p, gen in zip(logits, params, generators):
        if p.greedy:
            tok = int(torch.argmax(row))
            lp = torch.log_softmax(row, dim=-1)[tok]
        else:
            logp = torch.log_softmax(row / p.temperature, dim=-1)
            probs = _truncate(logp.exp(), p)
            tok = int(torch.multinomial(probs, 1, generator=gen))
            lp = logp[tok]
        tokens.append(tok)
        logprobs.append(float(lp))
    return tokens, logprobs
