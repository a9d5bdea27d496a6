"""Environments (rewards, tools, style schedule), the plug-in registry, prompt files and the resumable cursor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_sao.rollout.envs import REGISTRY, env_class, make_env
from megatron_sao.rollout.envs.arithmetic import calculate
from megatron_sao.rollout.envs.style_preference import STYLES, style_score
from megatron_sao.rollout.prompts import PromptCursor, read_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_calculator_evaluates_arithmetic_and_nothing_else() -> None:
    assert calculate("(3 * 4) - 5 / 2") == 9.5
    for bad in ("__import__('os')", "2 ** 10", "a + 1", "1 / 0", "x" * 300):
        with pytest.raises(ValueError):
            calculate(bad)


def test_arithmetic_episode_runs_the_tool_then_checks_the_answer() -> None:
    env = make_env("arithmetic")
    (rec,) = env.make_prompts(1, seed=3)
    ep = env.start(rec)
    step = ep.step("let me compute <tool_call>2 + 2 * 3</tool_call>")
    assert not step.done and step.observation == "<tool_response>8</tool_response>"
    assert ep.step("<tool_call>1 / 0</tool_call>").observation.startswith("<tool_response>error")
    assert ep.step(f"<answer>{rec['answer']}</answer>").done and ep.reward() == 1.0
    ep2 = env.start(rec)
    assert ep2.step("no idea").done and ep2.reward() == 0.0


def test_arithmetic_worked_examples_come_before_the_question_and_are_right() -> None:
    """`examples` (examples/smollm2_tools): the calculator called, its response and the answer, in the chat before
    the question, each correct by the calculator itself; more examples than it has is refused, naming the field."""
    from megatron_sao.rollout.envs.arithmetic import SYSTEM

    env = make_env("arithmetic", {"examples": 2, "max_operand": 999})
    (rec,) = env.make_prompts(1, seed=3)
    chat = env.start(rec).messages
    assert [m["role"] for m in chat] == ["system", *["user", "assistant", "tool", "assistant"] * 2, "user"]
    assert chat[0]["content"] == SYSTEM and chat[-1]["content"] == rec["question"]
    for user, call, response, answer in (chat[1:5], chat[5:9]):
        played = env.start({"question": user["content"], "answer": 0})
        assert played.step(call["content"]).observation == response["content"]
        assert response["content"].replace("tool_response", "answer") == answer["content"]
    assert make_env("arithmetic").start(rec).messages == [chat[0], chat[-1]]
    with pytest.raises(ValueError, match="rollout.env.options.examples"):
        make_env("arithmetic", {"examples": 3})


def test_verifiable_answer_is_single_turn_with_normalized_match() -> None:
    env = make_env("verifiable_answer")
    ep = env.start({"id": "a", "question": "q", "answer": "Paris"})
    assert ep.step("It is <answer> paris. </answer>").done and ep.reward() == 1.0
    ep = env.start({"id": "b", "question": "q", "answer": "8"})
    ep.step("the answer is 8.0")
    assert ep.reward() == 1.0


def test_style_preference_switches_on_schedule_and_records_the_style() -> None:
    env = make_env("style_preference", {"period": 10})
    assert [env.active_style(v) for v in (0, 9, 10, 25, 30)] == ["cute", "cute", "chuunibyou", "classical", "cute"]
    text = "verily thou art fair, and thee doth shine"
    rewards = {}
    for version in (0, 10, 20):
        ep = env.start({"id": "s", "prompt": "Write."})
        ep.step(text)
        ep.weight_version = version
        rewards[ep.reward(), ep.metadata["style"]] = version
    assert set(rewards) == {(0.0, "cute"), (0.0, "chuunibyou"), (1.0, "classical")}
    assert style_score("nya~ so fluffy", "cute") == 1.0
    by_count = make_env("style_preference", {"period": 2, "schedule": "episodes"})
    styles = []
    for _ in range(4):
        ep = by_count.start({"id": "s", "prompt": "Write."})
        ep.step("x")
        ep.reward()
        styles.append(ep.metadata["style"])
    assert styles == ["cute", "cute", "chuunibyou", "chuunibyou"]


def test_the_graded_style_reward_ranks_old_style_below_plain_below_new_and_records_the_adaptation_measures() -> None:
    """reward="graded" (experiments/online_adaptation.py): after a switch to chuunibyou the old style (cute) scores 0,
    a plain sentence 0.5, one new marker 0.75, two 1.0; the metadata carry the ratio score under the active style and
    under the style the next switch brings, whatever the reward."""
    env = make_env("style_preference", {"period": 10, "reward": "graded"})
    cases = {"nya so fluffy": 0.0, "a cat sat": 0.5, "a sealed cat": 0.75, "the sealed eye": 1.0,
             "sealed eye but nya": 0.75}  # fmt: skip
    for text, want in cases.items():
        ep = env.start({"id": "s", "prompt": "Write."})
        ep.step(text)
        ep.weight_version = 12  # chuunibyou; the next switch brings classical
        assert ep.reward() == want, text
        assert ep.metadata["style"] == "chuunibyou"
        assert ep.metadata["style_score"] == style_score(text, "chuunibyou")
        assert ep.metadata["next_style_score"] == style_score(text, "classical")
    ep = make_env("style_preference", {"period": 10}).start({"id": "s", "prompt": "Write."})
    ep.step("thou art sealed")
    ep.weight_version = 19  # the default ratio reward is unchanged: 1 hit / (1 + 1 other)
    assert ep.reward() == 0.5 == ep.metadata["style_score"] and ep.metadata["next_style_score"] == 0.5
    with pytest.raises(ValueError, match="reward='shiny'"):
        make_env("style_preference", {"reward": "shiny"})


def test_a_level_schedule_switches_once_the_style_is_learned_or_the_period_ends() -> None:
    """schedule="level" (experiments/online_adaptation.py): the style switches when the phase's last `window` style
    scores reach `level`, from the version after the newest seen (an episode of the old phase finishing late keeps its
    style and does not count for the new one); a phase that never reaches it ends after `period` versions."""
    env = make_env("style_preference", {"period": 10, "schedule": "level", "level": 0.5, "window": 2,
                                        "reward": "graded"})  # fmt: skip

    def episode(version: int, text: str) -> dict:
        ep = env.start({"id": "s", "prompt": "Write."})
        ep.step(text)
        ep.weight_version = version
        reward = ep.reward()
        assert ep.reward() == reward  # scored once
        return {**ep.metadata, "reward": reward}

    assert episode(0, "a cat")["style"] == "cute"
    assert episode(3, "nya nya")["phase"] == 0  # two scores: 0 and 1 -> mean 0.5: the switch, from version 4
    late = episode(3, "a sealed cat")  # generated by version 3: still cute, and not a score of the next phase
    assert (late["phase"], late["style"], late["reward"]) == (0, "cute", 0.25)
    after = episode(4, "a sealed cat")
    assert (after["phase"], after["style"], after["next_style_score"]) == (1, "chuunibyou", 0.0)
    assert after["reward"] == 0.75
    assert episode(13, "a cat")["phase"] == 1
    capped = episode(14, "a cat")  # phase 1 began at version 4 and never reached the level: it ends at 14
    assert (capped["phase"], capped["style"]) == (2, "classical")
    with pytest.raises(ValueError, match="schedule='weekly'"):
        make_env("style_preference", {"schedule": "weekly"})


def test_style_demonstrator_writes_every_style_alike_about_the_topic() -> None:
    """What tools/warm_start.py imitates for the online-adaptation experiment: one style per sentence, each about a
    third of the time; a mistake is a sentence with no markers at all."""
    import random
    from collections import Counter

    env = make_env("style_preference", {})
    rng = random.Random(0)
    context = "user: Write one short sentence about the moon.\nassistant:"
    won = Counter()
    for _ in range(600):
        text = env.demonstrate(context, rng, mistake_rate=0.1)
        assert text.startswith("the moon ")
        scores = {s: style_score(text, s) for s in STYLES}
        assert sorted(scores.values()) in ([0.0, 0.0, 0.0], [0.0, 0.0, 1.0])  # one style, fully, or none
        won[max(scores, key=scores.get) if max(scores.values()) else "none"] += 1
    assert 40 <= won["none"] <= 90  # ~10% mistakes
    assert all(150 <= won[s] <= 210 for s in STYLES), won
    only_cute = make_env("style_preference", {"styles": ["cute"]})
    assert style_score(only_cute.demonstrate(context, rng, 0.0), "cute") == 1.0


def test_registry_by_name_and_by_import_path() -> None:
    assert {"arithmetic", "style_preference", "verifiable_answer"} <= set(REGISTRY)
    cls = env_class("megatron_sao.rollout.envs.arithmetic:ArithmeticEnv")
    assert cls is REGISTRY["arithmetic"]
    with pytest.raises(ValueError, match="registered"):
        env_class("nope")
    with pytest.raises(ValueError, match="not an Environment"):
        env_class("json:dumps")
    with pytest.raises(ValueError, match="schedule"):
        make_env("style_preference", {"schedule": "weekly"})


@pytest.mark.multiproc
@pytest.mark.parametrize("env", ["arithmetic", "style_preference", "verifiable_answer"])
def test_make_prompts_tool_writes_loadable_jsonl(env: str, tmp_path: Path) -> None:
    out = tmp_path / f"{env}.jsonl"
    cmd = [sys.executable, str(REPO / "tools/make_prompts.py"), "--env", env, "--n", "7", "--out", str(out)]
    subprocess.run(cmd, check=True, env={"PYTHONPATH": str(REPO)}, capture_output=True)
    records = read_jsonl(out)
    assert len(records) == 7 and len({r["id"] for r in records}) == 7
    envobj = make_env(env)
    assert all(envobj.start(r).messages for r in records)


def test_cursor_resumes_pending_prompts_first_and_skips_completed(tmp_path: Path) -> None:
    records = [{"id": f"p{i}"} for i in range(5)]
    c = PromptCursor(records, epochs=2)
    taken = [c.take() for _ in range(3)]
    c.complete(taken[0][0])
    c.complete(taken[2][0])
    state = tmp_path / "cursor.json"
    c.save(state)
    resumed = PromptCursor(records, epochs=2)
    assert resumed.load(state)
    order = []
    while (item := resumed.take()) is not None:
        order.append(item[1]["id"])
        resumed.complete(item[0])
    assert order == ["p1", "p3", "p4", "p0@1", "p1@1", "p2@1", "p3@1", "p4@1"]
    assert json.loads(state.read_text())["completed"] == 2
    with pytest.raises(ValueError, match="another prompt file"):
        PromptCursor(records[:3]).load(state)


def test_key_chain_follows_the_keys_and_pays_only_the_exact_answer() -> None:
    env = make_env("key_chain")
    rec = next(r for r in env.make_prompts(50, seed=2) if r["hops"] == 3)
    ep = env.start(rec)
    key = rec["start"]
    for _ in range(3):
        step = ep.step(f"<tool_call>{key}</tool_call><|im_end|>")
        assert not step.done and step.observation is not None
        key = step.observation.removeprefix("<tool_response>").removesuffix("</tool_response>")
    assert key == str(rec["answer"])
    assert ep.step(f"<answer>{key}</answer>").done and ep.reward() == 1.0 and ep.metadata["lookups"] == 3
    wrong = env.start(rec)
    assert "error: no key" in (wrong.step("<tool_call>zz</tool_call>").observation or "")
    assert wrong.step("<answer>0</answer>").done and wrong.reward() == 0.0
    chatty = env.start(rec)  # anything around the one tag ends the episode unpaid
    assert chatty.step(f"sure! <tool_call>{rec['start']}</tool_call>").done and chatty.reward() == 0.0


def test_key_chain_lengths_are_long_tailed_and_its_demonstrator_errs_at_the_set_rate() -> None:
    import random
    from collections import Counter

    from megatron_sao.rollout.envs.key_chain import HOP_WEIGHTS

    env = make_env("key_chain")
    hops = Counter(r["hops"] for r in env.make_prompts(4000, seed=1))
    for h, w in enumerate(HOP_WEIGHTS, start=1):
        assert abs(hops[h] / 4000 - w) < 0.03, (h, hops[h])
    assert hops[1] > hops[2] > hops[3] > hops[4] > hops[5] > hops[6] > 0
    rng = random.Random(0)
    solved = []
    for rec in env.make_prompts(600, seed=3):
        ep, text = env.start(rec), f"Start: {rec['start']}"
        while True:
            turn = env.demonstrate(text, rng, 0.1)
            step = ep.step(turn)
            if step.done:
                break
            text += turn + (step.observation or "")
        solved.append(ep.reward())
    expected = sum(w * 0.9 ** (h + 1) for h, w in enumerate(HOP_WEIGHTS, start=1))  # h lookups + 1 answer, all right
    assert abs(sum(solved) / len(solved) - expected) < 0.05


def test_key_chain_with_visible_difficulty_draws_lengths_alike_and_errs_by_length() -> None:
    import random
    from collections import Counter, defaultdict

    rates = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4]
    env = make_env("key_chain", {"hops": "uniform", "show_hops": True, "mistakes_by_hops": rates})
    hops = Counter(r["hops"] for r in env.make_prompts(3000, seed=2))
    assert all(abs(hops[h] / 3000 - 1 / 6) < 0.03 for h in range(1, 7)), hops
    rng = random.Random(1)
    solved: dict[int, list[float]] = defaultdict(list)
    for rec in env.make_prompts(1800, seed=4):
        ep = env.start(rec)
        text = ep.messages[-1]["content"]
        assert text == f"Start: {rec['start']} (hops: {rec['hops']})"
        while True:
            turn = env.demonstrate(text, rng, 0.9)  # the table overrides the global rate
            step = ep.step(turn)
            if step.done:
                break
            text += turn + (step.observation or "")
        solved[rec["hops"]].append(ep.reward())
    for h, rate in enumerate(rates, start=1):
        assert abs(sum(solved[h]) / len(solved[h]) - (1 - rate) ** (h + 1)) < 0.08, (h, sum(solved[h]) / len(solved[h]))
    with pytest.raises(ValueError, match="needs show_hops"):
        make_env("key_chain", {"mistakes_by_hops": rates})
    with pytest.raises(ValueError, match="one rate in"):
        make_env("key_chain", {"show_hops": True, "mistakes_by_hops": [0.1]})


def test_key_chain_with_decoys_runs_every_episode_to_the_same_length_and_pays_only_the_true_chain() -> None:
    import random
    from collections import Counter

    env = make_env("key_chain", {"hops": "fixed", "max_hops": 4, "decoys": True})
    recs = env.make_prompts(400, seed=5)
    assert {r["hops"] for r in recs} == {4}
    rec = recs[0]

    def play(turns: list[str]) -> tuple[list[str], Any]:
        ep, seen = env.start(rec), []
        for turn in turns:
            step = ep.step(turn)
            seen.append(step.observation or "")
            if step.done:
                break
        return seen, ep

    key, right = rec["start"], []
    for _ in range(4):
        right.append(f"<tool_call>{key}</tool_call>")
        key = play(right)[0][-1].removeprefix("<tool_response>").removesuffix("</tool_response>")
    _, ep = play([*right, f"<answer>{key}</answer>"])
    assert ep.reward() == 1.0 and ep.metadata["decoy_at"] == 0 and ep.metadata["lookups"] == 4
    assert ep.metadata["turn_states"] == "5c,4c,3c,2c,1c"  # turns left, on the chain
    # a wrong second key: a capitalised decoy that runs on for the chain's length, then a wrong number
    turns = right[:1] + ["<tool_call>zz</tool_call>"]
    for _ in range(2):
        last = play(turns)[0][-1].removeprefix("<tool_response>").removesuffix("</tool_response>")
        assert last.isupper() and len(last) == len(rec["start"])
        turns.append(f"<tool_call>{last}</tool_call>")
    number = play(turns)[0][-1].removeprefix("<tool_response>").removesuffix("</tool_response>")
    assert number.isdigit() and int(number) != rec["answer"]
    _, ep = play([*turns, f"<answer>{number}</answer>"])
    assert ep.reward() == 0.0 and ep.metadata["decoy_at"] == 2 and ep.metadata["lookups"] == 4
    assert ep.metadata["turn_states"] == "5c,4c,3d,2d,1d"  # the decoy in sight from the third turn
    import msgspec

    from megatron_sao.bus.schema import MetadataValue

    msgspec.convert(ep.metadata, dict[str, MetadataValue])  # what the bus's header takes (a list was refused)
    assert play(turns)[0] == play(turns)[0]  # the decoy is the prompt's own: the same every time
    # the demonstrator at a per-turn mistake rate: every episode 4 lookups and an answer; success (1 - m)^5
    rng, lengths, solved = random.Random(2), Counter(), []
    for r in recs:
        ep, text, n = env.start(r), f"Start: {r['start']}", 0
        while True:
            turn = env.demonstrate(text, rng, 0.1)
            n += 1
            step = ep.step(turn)
            if step.done:
                break
            text += turn + (step.observation or "")
        lengths[n] += 1
        solved.append(ep.reward())
    assert lengths == Counter({5: 400})
    assert abs(sum(solved) / len(solved) - 0.9**5) < 0.06
    with pytest.raises(ValueError, match="hops: fixed"):
        make_env("key_chain", {"decoys": True})
