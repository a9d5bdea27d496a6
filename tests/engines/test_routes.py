"""The embedded engine's routed experts (SGLang's --enable-return-routed-experts, return_routed_experts,
routed_experts_start_len): they decode to [seqlen - 1 - start_len, num_hidden_layers, top_k] and equal the top-k of
its routers in one full-sequence transformers forward; the client refuses an engine that cannot return them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_sao.engines import protocol as P
from megatron_sao.engines.client import EngineBadRequest, SGLangClient
from megatron_sao.engines.embedded.model_runner import load_hf_model
from tests.engines.conftest import serve_in_thread


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def routed_engine(request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]) -> Iterator[tuple[str, Path]]:
    for url in serve_in_thread(tiny_dirs[request.param], 8, enable_return_routed_experts=True):
        yield url, tiny_dirs[request.param]


def routes_of(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, top_k] int32: each layer's router top-k in one full-sequence forward of `model` (zeros
    on dense layers)."""
    cfg = model.config
    out = np.zeros((len(tokens), cfg.num_hidden_layers, cfg.num_experts_per_tok), dtype=np.int32)

    def record(layer: int):
        def hook(_module, _inputs, output) -> None:
            out[:, layer] = output[2].reshape(len(tokens), -1).numpy()

        return hook

    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            hooks.append(gate.register_forward_hook(record(i)))
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return out


def reference_routes(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """routes_of the model in `model_dir` (the same transformers routers the engine runs)."""
    return routes_of(load_hf_model(model_dir), tokens)


def _same_sets(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (position, layer) whose expert sets agree (the order of equal-score experts may differ)."""
    return float((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(axis=-1).mean())


def test_routes_decode_to_the_documented_shape_and_equal_the_routers_top_k(routed_engine) -> None:
    url, model_dir = routed_engine
    client = SGLangClient(url)
    client.check_routes(multi_turn=True)
    prompt = [1, 7, 9, 12, 5]
    r = client.generate(prompt, {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
                        routed_experts_start_len=0)  # fmt: skip
    cfg = load_hf_model(model_dir).config
    layers, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    seq = prompt + r.output_ids
    assert r.routed_experts is not None and r.routed_experts.dtype == np.dtype("<i4")
    routes = r.routed_experts.reshape(-1, layers, k)
    assert routes.shape[0] == len(seq) - 1  # SGLang's [0, seqlen - 1): the last sampled token is never forwarded
    ref = reference_routes(model_dir, seq)[: len(seq) - 1]
    assert _same_sets(routes, ref) == 1.0
    dense = [i for i in range(layers) if not hasattr(getattr(load_hf_model(model_dir).model.layers[i].mlp, "gate",
                                                             None), "top_k")]  # fmt: skip
    assert all((routes[:, i] == 0).all() for i in dense)
    assert (routes.min() >= 0) and routes.max() < int(getattr(cfg, "num_experts", 0) or cfg.n_routed_experts)


def test_start_len_returns_only_the_later_positions(routed_engine) -> None:
    url, model_dir = routed_engine
    client = SGLangClient(url)
    prompt = [3, 4, 8, 2, 6, 11, 13]
    sp = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    full = client.generate(prompt, sp, routed_experts_start_len=0)
    tail = client.generate(prompt, sp, routed_experts_start_len=5)
    width = full.routed_experts.size // (len(prompt) + 3)
    assert tail.routed_experts.size == (len(prompt) + 3 - 5) * width
    np.testing.assert_array_equal(tail.routed_experts, full.routed_experts[5 * width :])
    body = P.build_generate_request(prompt, sp)
    body.update(return_routed_experts=True, routed_experts_start_len=len(prompt) + 1)
    with pytest.raises(EngineBadRequest, match="routed_experts_start_len"):
        client.request("POST", P.GENERATE, body)
    assert "routed_experts" not in client.request("POST", P.GENERATE, P.build_generate_request(prompt, sp))["meta_info"]


def test_an_engine_without_the_flag_returns_none_and_is_refused(engine_url: str) -> None:
    client = SGLangClient(engine_url)
    body = P.build_generate_request([1, 2, 3], {"max_new_tokens": 2}, routed_experts_start_len=0)
    out = client.request("POST", P.GENERATE, body)
    assert "routed_experts" not in out["meta_info"]  # SGLang without the flag: silently none
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        P.parse_generate_response(out, expect_routes=True)
    with pytest.raises(ValueError, match="started without --enable-return-routed-experts"):
        client.check_routes(multi_turn=False)


def test_old_releases_are_refused_naming_the_release(monkeypatch, engine_url: str) -> None:
    client = SGLangClient(engine_url)
    info = {"version": "0.5.6", "enable_return_routed_experts": True}
    monkeypatch.setattr(client, "server_info", lambda: info)
    with pytest.raises(ValueError, match=r"SGLang 0\.5\.6, which cannot return routed experts \(0\.5\.7\+\)"):
        client.check_routes(multi_turn=False)
    info["version"] = "0.5.7"
    client.check_routes(multi_turn=False)
    with pytest.raises(ValueError, match=r"routed_experts_start_len \(0\.5\.8\+\)"):
        client.check_routes(multi_turn=True)


def test_a_dense_model_cannot_capture(tmp_path: Path) -> None:
    from megatron_sao.engines.embedded.model_runner import RouteCapture

    class Dense(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("C", (), {"num_hidden_layers": 1, "num_experts_per_tok": 0})()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])

    with pytest.raises(ValueError, match="no MoE router"):
        RouteCapture(Dense())
