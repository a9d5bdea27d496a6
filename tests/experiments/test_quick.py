"""Every experiment's --quick variant end to end (the real processes, a few steps each): the PNG is written, the JSON
holds a row per arm / variant / switch, and the results file gets the table between its markers, twice without
duplicating it. Minutes each: slow tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _quick(script: str, tmp_path: Path, timeout_s: float = 1200) -> tuple[str, Path, Path]:
    results, figures = tmp_path / "results.md", tmp_path / "figures"
    results.write_text("# Results\n\nkept text\n")
    cmd = [sys.executable, str(REPO / "experiments" / script), "--quick", "--runs", str(tmp_path / "runs"),
           "--results", str(results), "--figures", str(figures)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, results, figures


def _section(results: Path, name: str) -> str:
    text = results.read_text()
    assert "kept text" in text and text.count(f"<!-- experiments:{name} -->") == 1
    return text.split(f"<!-- experiments:{name} -->")[1].split(f"<!-- /experiments:{name} -->")[0]


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.multiproc
def test_learning_efficiency_quick(tmp_path: Path) -> None:
    out, results, figures = _quick("learning_efficiency.py", tmp_path)
    _png(figures / "learning_efficiency_quick.png")
    data = json.loads((figures / "learning_efficiency_quick.json").read_text())
    assert [a["arm"] for a in data["arms"]] == ["sao", "grpo", "grpo_async", "running_mean"]
    for arm in data["arms"]:
        (seed,) = arm["seeds"]
        assert seed["generated_tokens"] >= 2500 and seed["trajectories"] > 0  # the budget stopped every run
        assert 0 <= seed["held_out"] <= 1 and 0 <= seed["held_out_greedy"] <= 1  # its checkpoint was evaluated
        assert seed["stale_dropped"] == 0 and 0.5 < seed["trained_share"] <= 1  # admission: nothing thrown away
        assert seed["staleness_max"] <= 4
    assert [c["name"] for c in data["criteria"]] == ["E1", "E2", "E3"]
    assert all(c["holds"] is None for c in data["criteria"])  # one seed: no verdict
    section = _section(results, "learning_efficiency_quick")
    assert "learning_efficiency_quick.png" in section
    for arm in ("sao", "grpo", "grpo_async", "running_mean"):
        (row,) = [line for line in section.splitlines() if line.startswith(f"| `{arm}` |")]
        assert row in out  # the table in the file is the one the script printed
    # a second pass reads the finished runs back and rewrites the section in place
    again, results, _ = _quick("learning_efficiency.py", tmp_path)
    assert " policy steps, " not in again  # nothing trained again
    _section(results, "learning_efficiency_quick")


@pytest.mark.slow
@pytest.mark.multiproc
def test_ablations_quick(tmp_path: Path) -> None:
    out, results, figures = _quick("ablations.py", tmp_path)
    _png(figures / "ablations_quick.png")
    data = json.loads((figures / "ablations_quick.json").read_text())
    assert list(data["variants"]) == ["sao", "plain_is", "k1", "critic_attention", "gae_through_observations"]
    assert data["variants"]["plain_is"][0]["masked_frac"] == 0.0  # plain IS masks nothing
    assert all(0 <= v[0]["held_out"] <= 1 for v in data["variants"].values())  # every checkpoint evaluated
    assert [c["name"] for c in data["criteria"]] == ["plain_is", "k1", "critic_attention", "gae_through_observations"]
    section = _section(results, "ablations_quick")
    assert section.count("\n| `") == 5


@pytest.mark.slow
@pytest.mark.multiproc
def test_stability_quick(tmp_path: Path) -> None:
    out, results, figures = _quick("stability.py", tmp_path)
    _png(figures / "stability_quick.png")
    data = json.loads((figures / "stability_quick.json").read_text())
    assert data["policy_steps"] == 12 and data["losses_finite"] and isinstance(data["collapsed"], bool)
    section = _section(results, "stability_quick")
    assert "| collapsed |" in section and ("did not collapse" in section or "collapsed**" in section)


@pytest.mark.slow
@pytest.mark.multiproc
def test_online_adaptation_quick(tmp_path: Path) -> None:
    out, results, figures = _quick("online_adaptation.py", tmp_path)
    _png(figures / "online_adaptation_quick.png")
    data = json.loads((figures / "online_adaptation_quick.json").read_text())
    assert list(data["arms"]) == ["sao", "running_mean"]
    for arm in data["arms"].values():
        (seed,) = arm
        assert [s["switch"] for s in seed["switches"]] == ["cute -> chuunibyou", "chuunibyou -> classical"]
        for s in seed["switches"]:  # every switch either recovered, censored at the period, or without a target
            assert s["status"] in ("recovered", "censored", "no pre-switch level", "not reached")
            assert (s["versions"] == 3) if s["censored"] else (s["versions"] is None or 0 <= s["versions"] < 3)
    # O1 only where both arms measured a recovery time (a seed without any pre-switch level has none); one seed: no
    # verdict either way
    assert {c["name"] for c in data["criteria"]} <= {"O1"} and all(c["holds"] is None for c in data["criteria"])
    section = _section(results, "online_adaptation_quick")
    assert section.count("\n| `") == 2 and "**GATE**" in section


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(1500)  # a probe, five arms and their held-out evaluations: past pytest-timeout's 10 min when busy
def test_critic_matters_quick(tmp_path: Path) -> None:
    out, results, figures = _quick("critic_matters.py", tmp_path, timeout_s=1450)
    _png(figures / "critic_matters_quick.png")
    data = json.loads((figures / "critic_matters_quick.json").read_text())
    assert 0.0 <= data["probe"]["r2"] <= 1.0 and data["probe"]["success_by_hops"]
    assert [a["arm"] for a in data["arms"]] == ["running_mean", "oracle_mean", "sao", "sao_whiten", "grpo"]
    by_arm = {a["arm"]: a["seeds"][0] for a in data["arms"]}
    for arm in ("sao", "sao_whiten"):
        assert by_arm[arm]["pretrain_trajectories"] > 0  # value pre-training ran and its tokens are counted
    for arm in ("running_mean", "oracle_mean", "grpo"):
        assert by_arm[arm]["pretrain_trajectories"] == 0 and by_arm[arm]["explained_variance"] is None
    for seed in by_arm.values():  # the on-policy measure: each run's checkpoint at the budget, held out
        assert 0.0 <= seed["held_out"] <= 1.0 and 0.0 <= seed["held_out_greedy"] <= 1.0, seed
    section = _section(results, "critic_matters_quick")
    assert "R^2 = " in section and section.count("\n| `") == 5


@pytest.mark.slow
@pytest.mark.multiproc
def test_routing_replay_quick(tmp_path: Path) -> None:
    _, results, figures = _quick("routing_replay.py", tmp_path)
    body = _section(results, "routing_replay_quick")
    assert "| free | 3 |" in body and "| replay | 3 |" in body and "| replay_critic | 3 |" in body
    _png(figures / "routing_replay_quick.png")
    arms = json.loads((figures / "routing_replay_quick.json").read_text())["arms"]
    runs = [r for arm in arms.values() for r in arm]
    assert len(runs) == 9 and all(r["policy_steps"] == 6 and r["routing/mismatch_frac"] is not None for r in runs)
    assert all(r["value/explained_variance"] is not None for r in runs)


@pytest.mark.slow
@pytest.mark.multiproc
def test_credit_quick(tmp_path: Path) -> None:
    out, results, figures = _quick("credit.py", tmp_path)
    _png(figures / "credit_quick.png")
    data = json.loads((figures / "credit_quick.json").read_text())
    assert list(data["arms"]) == ["running_mean", "oracle_td", "sao"]
    for seeds in data["arms"].values():
        (seed,) = seeds
        assert 0.0 <= seed["held_out"] <= 1.0 and 0.0 <= seed["held_out_greedy"] <= 1.0  # the checkpoint evaluated
        assert seed["stale_max"] <= 4  # rollout admission: within bus.max_staleness
    assert [c["name"] for c in data["criteria"]] == ["GATE", "H1"]  # grpo not in the quick arms: no H2
    assert all(c["holds"] is None for c in data["criteria"])  # one seed: no verdict
    section = _section(results, "credit_quick")
    assert "**GATE**" in section and section.count("\n| `") == 3
