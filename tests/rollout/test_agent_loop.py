"""Agent-loop accounting: token ids, action mask, rollout log-probs and weight versions of multi-turn episodes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megatron_sao.engines.client import EngineRouter
from megatron_sao.engines.protocol import GenerateResult
from megatron_sao.models.tiny import build_tiny_tokenizer
from megatron_sao.rollout.agent_loop import AgentLoop, AgentLoopConfig, ChatTemplateCodec, EpisodeAborted
from megatron_sao.rollout.envs import make_env
from megatron_sao.rollout.envs.base import Environment, Episode, StepResult

TOK = build_tiny_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")


def enc(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class ScriptedEngine:
    """Answers each /generate with the next scripted turn; records what it was sent."""

    def __init__(self, turns: list[list[int]], finish: list[str] | None = None, versions: list[int] | None = None):
        self.turns, self.finish = list(turns), list(finish or ["stop"] * len(turns))
        self.versions = list(versions or [5] * len(turns))
        self.calls: list[tuple[list[int], dict[str, Any]]] = []

    def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
        self.calls.append((list(input_ids), dict(sampling)))
        ids, finish, v = self.turns.pop(0), self.finish.pop(0), self.versions.pop(0)
        logprobs = [-0.01 * (len(self.calls) * 100 + k) for k in range(len(ids))]  # unique per token
        reason = {"type": finish}
        return GenerateResult("rid", ids, logprobs, [v] * len(ids), finish, reason, v, len(input_ids)), "fake:1"


def loop(env: Environment, engine: Any, **cfg: Any) -> AgentLoop:
    return AgentLoop(env, ChatTemplateCodec(TOK), engine, AgentLoopConfig(**cfg))


def test_multi_turn_tokens_mask_logprobs_and_versions_are_exact() -> None:
    env = make_env("arithmetic")
    prompt = {"id": "p0", "question": "Compute 3 * 4.", "answer": 12}
    t0 = enc("<tool_call>3 * 4</tool_call>") + [IM_END]
    t1 = enc("<answer>12</answer>") + [IM_END]
    engine = ScriptedEngine([t0, t1], versions=[3, 4])
    traj = loop(env, engine, max_turns=4).run(prompt, worker_id="w", sample_index=0)

    # The sequence is exactly the chat template's tokenization of the whole conversation.
    messages = env.start(prompt).messages
    head = TOK.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    convo = [*messages, {"role": "assistant", "content": "<tool_call>3 * 4</tool_call>"},
             {"role": "tool", "content": "<tool_response>12</tool_response>"},
             {"role": "assistant", "content": "<answer>12</answer>"}]  # fmt: skip
    full = enc(TOK.apply_chat_template(convo, tokenize=False))
    p = len(enc(head))
    obs = enc("\n<|im_start|>tool\n<tool_response>12</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert traj.tokens.tolist() == enc(head) + t0 + obs + t1 == full[:-1]  # full ends with the template's last "\n"
    assert traj.header.prompt_len == p

    mask = np.zeros(len(traj.tokens), dtype=bool)
    a0, o0, a1 = p, p + len(t0), p + len(t0) + len(obs)
    mask[a0:o0] = True
    mask[a1:] = True
    assert traj.action_mask.tolist() == mask.tolist()  # observations are never actions
    assert traj.rollout_logprobs[~mask].tolist() == [0.0] * int((~mask).sum())
    expected_lp = [-0.01 * (100 + k) for k in range(len(t0))] + [-0.01 * (200 + k) for k in range(len(t1))]
    assert np.allclose(traj.rollout_logprobs[mask], expected_lp)  # aligned with their tokens
    assert traj.weight_versions.tolist() == [-1] * p + [3] * len(t0) + [-1] * len(obs) + [4] * len(t1)
    (turn0, turn1) = traj.header.turns
    assert (turn0.action_start, turn0.action_end, turn0.observation_end) == (a0, o0, a1)
    assert (turn1.action_start, turn1.action_end, turn1.observation_end) == (a1, len(traj.tokens), len(traj.tokens))
    assert engine.calls[1][0] == traj.tokens[:a1].tolist()  # turn 2 continues from exactly these tokens
    assert traj.header.reward == 1.0 and traj.header.finish_reason == "stop"
    assert traj.header.metadata["env"] == "arithmetic" and traj.header.metadata["weight_version"] == 4
    assert traj.oldest_version() == 3


def test_unclosed_turn_gets_the_end_of_turn_token_as_observation() -> None:
    t0 = enc("<tool_call>1 + 1</tool_call>")  # hit max_new_tokens before <|im_end|>
    engine = ScriptedEngine([t0, enc("<answer>2</answer>") + [IM_END]], finish=["length", "stop"])
    traj = loop(make_env("arithmetic"), engine).run({"id": "p", "question": "Compute 1 + 1.", "answer": 2})
    a_end = traj.header.turns[0].action_end
    assert traj.tokens[a_end] == IM_END and not traj.action_mask[a_end]
    assert traj.tokens[traj.header.turns[0].action_end - 1] != IM_END


def test_turn_limit_ends_on_actions_without_a_dangling_observation() -> None:
    call = enc("<tool_call>2 * 2</tool_call>") + [IM_END]
    traj = loop(make_env("arithmetic"), ScriptedEngine([call, call]), max_turns=2).run(
        {"id": "p", "question": "Compute 2 * 2.", "answer": 4}
    )
    assert traj.header.finish_reason == "turn_limit" and len(traj.header.turns) == 2
    last = traj.header.turns[-1]
    assert last.observation_end == last.action_end == len(traj.tokens) and traj.action_mask[-1]
    assert traj.header.reward == 0.0


def test_token_limit_caps_max_new_tokens_and_stops() -> None:
    env = make_env("arithmetic")
    prompt = {"id": "p", "question": "Compute 5 - 3.", "answer": 2}
    p = len(ChatTemplateCodec(TOK).prompt_ids(env.start(prompt).messages))
    t0 = enc("<tool_call>5 - 3</tool_call>") + [IM_END]
    engine = ScriptedEngine([t0])
    budget = len(t0) + 5  # room for the turn but not for the observation and a next turn
    traj = loop(env, engine, max_total_tokens=p + budget, sampling={"max_new_tokens": 1000}).run(prompt)
    assert engine.calls[0][1]["max_new_tokens"] == budget
    assert traj.header.finish_reason == "token_limit" and traj.header.num_tokens == p + len(t0)


def test_aborted_turn_raises_for_the_worker_to_reissue() -> None:
    class Aborting(ScriptedEngine):
        def __call__(self, input_ids: list[int], sampling: dict[str, Any]) -> tuple[GenerateResult, str]:
            r, e = super().__call__(input_ids, sampling)
            return GenerateResult("rid", r.output_ids, r.logprobs, r.versions, "abort", {"type": "abort"}, 5, 1), e

    with pytest.raises(EpisodeAborted):
        loop(make_env("verifiable_answer"), Aborting([[5, 6]])).run({"id": "p", "question": "q?", "answer": "8"})


@dataclass
class _EchoEpisode(Episode):
    turns: int = 0

    def step(self, action_text: str) -> StepResult:
        self.turns += 1
        return StepResult(done=self.turns >= 3, observation=f"observation {self.turns}")

    def reward(self) -> float:
        return 0.5


class EchoEnv(Environment):
    """Three turns whatever the model says (makes a random model multi-turn)."""

    name = "echo_test"

    def make_prompts(self, n: int, seed: int = 0) -> list[dict[str, Any]]:
        return [{"id": str(i), "prompt": "hello"} for i in range(n)]

    def start(self, prompt: dict[str, Any]) -> Episode:
        return _EchoEpisode(messages=[{"role": "user", "content": prompt["prompt"]}])


def test_rollout_logprobs_on_a_real_engine_align_with_a_full_forward(
    engine_url: str, tiny_dirs: dict[str, Path]
) -> None:
    from megatron_sao.engines.embedded.model_runner import load_hf_model

    router = EngineRouter.from_urls([engine_url])
    sampling = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    traj = AgentLoop(EchoEnv(), ChatTemplateCodec(TOK), router.generate, AgentLoopConfig(sampling=sampling)).run(
        {"id": "x", "prompt": "hello"}
    )
    assert len(traj.header.turns) == 3 and traj.num_action_tokens == 18
    model = load_hf_model(tiny_dirs["qwen3_moe"])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([traj.tokens.tolist()])).logits[0].float(), -1)
    idx = np.nonzero(traj.action_mask)[0]
    ref = logp[idx - 1, torch.tensor(traj.tokens[idx], dtype=torch.long)].numpy()
    assert np.abs(ref - traj.rollout_logprobs[idx]).max() <= 1e-4
    assert (traj.weight_versions[idx] == 0).all() and (traj.weight_versions[~traj.action_mask] == -1).all()


def test_multi_turn_routes_are_those_of_the_forwards_that_made_the_logprobs(
    routed_engine_url: str, tiny_dirs: dict[str, Path]
) -> None:
    """Each turn asks only for the positions no earlier turn forwarded (routed_experts_start_len); together they
    are the T - 1 rows of the trajectory, equal to the routers' top-k in one full forward (the weights did not
    change), and the trajectory crosses the bus."""
    from megatron_sao.bus import codec
    from megatron_sao.bus.schema import Routes
    from megatron_sao.engines.client import SGLangClient
    from tests.bus.test_routes import LIMITS
    from tests.engines.test_routes import reference_routes

    hf = json.loads((tiny_dirs["qwen3_moe"] / "config.json").read_text())
    spec = Routes.of_model(hf, hf.get("num_experts") or hf["num_local_experts"])
    client = SGLangClient(routed_engine_url)
    starts: list[int] = []

    def generate(ids: list[int], sampling: dict[str, Any], **kw: Any) -> tuple[GenerateResult, str]:
        starts.append(kw["routed_experts_start_len"])
        return client.generate(ids, sampling, **kw), client.url

    sampling = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    traj = AgentLoop(EchoEnv(), ChatTemplateCodec(TOK), generate, AgentLoopConfig(sampling=sampling, routes=spec)).run(
        {"id": "x", "prompt": "hello"}
    )
    turns = traj.header.turns
    assert len(turns) == 3 and starts == [0, turns[0].action_end - 1, turns[1].action_end - 1]
    assert traj.routes.shape == (traj.header.num_tokens - 1, spec.num_layers, spec.top_k)
    assert traj.routes.dtype == np.uint8 and traj.header.routes == spec
    ref = reference_routes(tiny_dirs["qwen3_moe"], traj.tokens.tolist())[:-1]
    assert (np.sort(ref, -1) == np.sort(traj.routes.astype(np.int32), -1)).all()
    got, _ = codec.decode([bytes(f) for f in codec.encode(traj)], LIMITS)
    np.testing.assert_array_equal(got.routes, traj.routes)


def test_routes_of_the_wrong_model_are_refused_naming_the_engine() -> None:
    from megatron_sao.bus.schema import Routes

    spec = Routes(num_layers=2, top_k=2, num_experts=4)

    def generate(ids: list[int], sampling: dict[str, Any], **kw: Any) -> tuple[GenerateResult, str]:
        ids3 = np.zeros(3, dtype=np.int32)  # 3 ids: not positions x 2 layers x 2
        return GenerateResult("r", [5], [-0.1], [0], "stop", {"type": "stop"}, 0, len(ids), routed_experts=ids3), "e"

    with pytest.raises(ValueError, match="engine e returned 3 ids routed experts"):
        AgentLoop(make_env("verifiable_answer"), ChatTemplateCodec(TOK), generate,
                  AgentLoopConfig(routes=spec)).run({"id": "p", "question": "q?", "answer": "8"})  # fmt: skip
