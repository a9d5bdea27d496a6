"""`python -m megatron_sao plan`: both examples fit at the node counts their READMEs give; broken configs (EP not
dividing the experts, a PP split that does not match the layers, a learner over 80 GB, engines whose weights do not
fit, too few nodes, layouts the learner refuses) exit non-zero naming the field to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_sao.cli import main
from megatron_sao.config import load_config
from megatron_sao.plan.plan import Hardware, make_plan

ROOT = Path(__file__).resolve().parents[2]
QWEN = str(ROOT / "examples/qwen3_30b/config.yaml")
GLM = str(ROOT / "examples/glm_750b/config.yaml")
GLM_HW = ["--nodes", "96", "--engine-gpu-mem-gb", "141"]  # H200 engine nodes (examples/glm_750b/README.md)


def plan_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_qwen_example_fits_on_six_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = plan_cli(capsys, QWEN, "--nodes", "6")
    assert rc == 0, out
    assert "30.5B parameters, 3.4B active" in out and "TP=4 PP=1 CP=1 EP=16 ETP=1 DP=8 expert-DP=2" in out
    assert out.rstrip().endswith("fits")


def test_glm_example_fits_on_96_nodes_with_h200_engines(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = plan_cli(capsys, GLM, *GLM_HW)
    assert rc == 0, out
    assert "743.9B parameters" in out and "39.9B without embeddings" in out
    assert "layers per stage [9, 10, 10, 10, 10, 10, 10, 9]" in out  # the automatic uneven split
    assert "engines serve fp8 weights" in out
    # buckets fill to 1 GB within each stage's dense tensors and experts, one update request per engine each
    assert "746.0 GB to every engine rank" in out  # the engines' block-FP8 format: a byte per parameter + scales
    assert "704 buckets of 1024 MB" in out and "22,528 update requests (704 buckets x 32 engines)" in out


@pytest.mark.parametrize(
    ("config", "argv", "rc", "field"),
    [
        # EP must divide the 256 routed experts (60 ranks per stage divide the world of 480 but not 256)
        (GLM, ["--launch.nnodes", "60", "--parallel.expert", "60", "--parallel.tensor", "4"], 2, "parallel.expert"),
        # 78 layers: 9 on the first stage and 9 on the last leave 60 for 6 stages; 8 + 9 leave 61
        (GLM, ["--parallel.first_stage_layers", "8", "--parallel.last_stage_layers", "9"], 1,
         "parallel.first_stage_layers"),
        # TP=2 without recompute: 215 GB per GPU; the plan names the nearest setting that fits
        (QWEN, ["--parallel.tensor", "2", "--learner.recompute", "none"], 1, "parallel.tensor"),
        (QWEN, ["--launch.nnodes", "2"], 1, "launch.nnodes"),  # optimizer state alone over 80 GB
        (QWEN, ["--parallel.context", "2"], 1, "parallel.context"),  # the learner refuses CP > 1
        (QWEN, ["--rollout.sglang.ep", "3"], 1, "rollout.sglang.ep"),
        (QWEN, ["--rollout.sglang.tp", "1", "--rollout.sglang.mem_fraction_static", "0.3"], 1, "rollout.sglang.tp"),
    ],
)  # fmt: skip
def test_broken_configs_name_the_field(capsys: pytest.CaptureFixture[str], config: str, argv: list[str], rc: int,
                                       field: str) -> None:  # fmt: skip
    nodes = ["--nodes", "96", "--engine-gpu-mem-gb", "141"] if config == GLM else ["--nodes", "6"]
    got, out = plan_cli(capsys, config, *nodes, *argv)
    assert got == rc, out
    assert field in out, out


def test_glm_engines_need_more_than_80_gb(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = plan_cli(capsys, GLM, "--nodes", "96", "--rollout.sglang.extra_args", "[]")
    assert rc == 1
    assert "rollout.sglang.tp: an engine GPU holds 186.0 GB of weights" in out


GLM_H100 = ["--nodes", "128", "--gpus-per-node", "8", "--gpu-mem-gb", "80", "--engine-gpu-mem-gb", "80",
            "--rollout.sglang.tp", "16", "--rollout.sglang.ep", "16", "--rollout.sglang.nnodes", "2",
            "--launch.rollout_nodes", "64", "--rollout.concurrency", "16"]  # fmt: skip
"""GLM-5 on H100s only: 32 engines of TP=16 over two 8-GPU nodes each (examples/glm_750b/README.md)."""


def test_glm_fits_on_h100_engines_that_span_two_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = plan_cli(capsys, GLM, *GLM_H100)
    assert rc == 0, out
    assert "32 SGLang servers x TP=16, EP=16" in out and out.rstrip().endswith("fits")
    rc, out = plan_cli(capsys, GLM, *[a for a in GLM_H100 if a not in ("--rollout.sglang.nnodes", "2")])
    assert rc == 1 and "rollout.sglang.nnodes: an engine takes rollout.sglang.tp x dp = 16 GPUs" in out


def test_too_few_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = plan_cli(capsys, QWEN, "--nodes", "5")
    assert rc == 1 and "launch.rollout_nodes" in out and "allocate 6 nodes" in out


def test_ep_not_dividing_experts_without_a_declared_count() -> None:
    """The config does not declare model.num_experts (it is read from config.json): the plan itself refuses."""
    cfg = load_config(GLM, ["--model.num_experts", "null", "--launch.nnodes", "60", "--parallel.expert", "60",
                            "--parallel.tensor", "4"])  # fmt: skip
    hf = json.loads((ROOT / "examples/glm_750b/hf_config.json").read_text())
    plan = make_plan(cfg, hf, Hardware(nodes=96, engine_gpu_mem_gb=141))
    assert [m.field for m in plan.misfits][:1] == ["parallel.expert"]
    assert "256 routed experts" in plan.misfits[0].message


def test_learner_memory_grows_with_the_micro_batch() -> None:
    cfg = load_config(QWEN)
    hf = json.loads((ROOT / "examples/qwen3_30b/hf_config.json").read_text())
    small = make_plan(load_config(QWEN, ["--rollout.max_total_tokens", "8192", "--learner.max_tokens_per_microbatch",
                                         "8192"]), hf, Hardware(nodes=6))  # fmt: skip
    full = make_plan(cfg, hf, Hardware(nodes=6))
    assert small.worst_stage.activations < full.worst_stage.activations / 3
    assert small.worst_stage.policy.static == full.worst_stage.policy.static


def test_missing_model_config_is_a_clear_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text((ROOT / "examples/qwen3_30b/config.yaml").read_text())
    rc, out = plan_cli(capsys, str(config), "--nodes", "6")
    assert rc == 2 and "model.hf_path" in out and "--hf-config" in out
    rc, out = plan_cli(capsys, str(config), "--nodes", "6", "--hf-config", str(ROOT / "examples/qwen3_30b"
                                                                               "/hf_config.json"))  # fmt: skip
    assert rc == 0, out


def test_a_critic_on_its_own_ranks_is_planned_at_its_own_layout(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--learner.value_on_separate_ranks", "true", "--launch.value_nnodes", "2", "--launch.value_nproc_per_node",
            "8", "--learner.value_parallel.tensor", "4", "--learner.value_parallel.expert", "8",
            "--learner.value_parallel.expert_tensor", "1"]  # fmt: skip
    cfg = load_config(QWEN, argv)
    hf = json.loads((ROOT / "examples/qwen3_30b/hf_config.json").read_text())
    separate = make_plan(cfg, hf, Hardware(nodes=8))
    shared = make_plan(load_config(QWEN, []), hf, Hardware(nodes=6))
    assert separate.value_world == 16 and separate.value_layout.dp == 4 and separate.value_layout.ep == 8
    # the learner's GPUs hold the policy alone; the value job's the critic alone, with no push staging
    assert all(s.critic is None for s in separate.stages) and all(s.critic for s in shared.stages)
    assert all(s.policy is None and s.critic and s.sync_staging == 0 for s in separate.value_stages)
    assert separate.worst_stage.total < shared.worst_stage.total
    rc, out = plan_cli(capsys, QWEN, "--nodes", "8", *argv)
    assert rc == 0, out
    assert "value job (learner.value_on_separate_ranks): 16 ranks, TP=4 PP=1 EP=8 DP=4" in out
    assert "value job memory per GPU" in out
    rc, out = plan_cli(capsys, QWEN, "--nodes", "6", *argv)  # 4 learner + 2 value + 2 engine nodes do not fit in 6
    assert rc == 1 and "launch.value_nnodes" in out, out


def test_the_push_paths_say_what_each_engine_rank_receives_and_how_long_the_engines_stop() -> None:
    """full: every engine rank receives the whole model and the engines stop for the push (SGLang); sharded: 1/TP
    of it per rank, the bucket leaving the source's node through one relay per engine TP rank (Qwen: TP=2, so
    half the full push's time at the source's NIC, plus the latencies), the engines stopped only for the commit,
    and the staged copy is memory the KV pool must give up. The planned
    (SGLang) engines take the full path; weight_sync.transfer=sharded with them does not fit, naming the field."""
    cfg = load_config(QWEN, [])
    hf = json.loads((ROOT / "examples/qwen3_30b/hf_config.json").read_text())
    plan = make_plan(cfg, hf, Hardware(nodes=6))
    full, sharded = plan.sync.paths["full"], plan.sync.paths["sharded"]
    tp = cfg.rollout.sglang.tp
    assert plan.sync.taken == "full" and cfg.rollout.engine == "sglang"
    assert sharded.bytes_per_engine_rank == pytest.approx(full.bytes_per_engine_rank / tp)
    assert full.stall_s == full.transfer_s and full.push_s == full.transfer_s
    assert sharded.relays == tp == 2 and full.relays == 1
    latency = full.transfer_s - full.bytes_per_engine_rank / (400 / 8 * 1e9 * 0.9)
    assert sharded.transfer_s == pytest.approx(full.bytes_per_engine_rank / tp / (400 / 8 * 1e9 * 0.9) + latency)
    assert 0 < sharded.stall_s < 0.1 * sharded.transfer_s and sharded.push_s > sharded.transfer_s
    assert sharded.staging_bytes == sharded.bytes_per_engine_rank
    forced = make_plan(load_config(QWEN, ["--weight_sync.transfer", "sharded"]), hf, Hardware(nodes=6))
    assert [m.field for m in forced.misfits] == ["weight_sync.transfer"]
    glm = make_plan(load_config(GLM, []), json.loads((ROOT / "examples/glm_750b/hf_config.json").read_text()),
                    Hardware(nodes=96, engine_gpu_mem_gb=141))  # fmt: skip
    assert any("a shard-aware push stages 93.2 GB per engine GPU" in n for n in glm.notes), glm.notes


def test_a_push_pays_every_buckets_control_in_one_order_whatever_the_stages() -> None:
    """Every stage's buckets reach the engines in ONE order (PushOrder) and SGLang holds its pause across each
    update's receive and load: the control of all buckets adds up, not a stage's share of it (GLM-5: PP=8)."""
    from megatron_sao.plan.plan import BUCKET_OVERHEAD_S, CONTROL_CALL_S, CONTROL_CALLS_PER_ENGINE

    glm = make_plan(load_config(GLM, []), json.loads((ROOT / "examples/glm_750b/hf_config.json").read_text()),
                    Hardware(nodes=96, engine_gpu_mem_gb=141))  # fmt: skip
    s = glm.sync
    assert s.sources == 8 and s.buckets > 8
    control = s.buckets * BUCKET_OVERHEAD_S + CONTROL_CALLS_PER_ENGINE * CONTROL_CALL_S
    assert s.seconds == pytest.approx(s.floor_seconds + control)
    assert s.paths["full"].transfer_s == pytest.approx(s.seconds)


def test_the_agent_path_sends_dense_tensors_whole_and_each_rank_its_experts_and_stops_the_engines_for_the_handover(
) -> None:  # fmt: skip
    """agent (weight_sync.agent): each engine rank takes the dense tensors whole and 1/EP of the experts; the
    engines stop only for the handover (host -> GPU copy and load of that slice, plus its calls), which the learner
    waits for; the agent stages one part and one bucket on the GPU, not the slice. Without expert parallelism it
    moves the whole model per rank, and its handover is no shorter than the full push's stall: the plan says so."""
    from megatron_sao.plan.plan import H2D_GB_S

    hf = json.loads((ROOT / "examples/glm_750b/hf_config.json").read_text())
    over = ["--rollout.sglang.tp", "32", "--rollout.sglang.ep", "32", "--rollout.sglang.nnodes", "4",
            "--rollout.num_engines", "8"]  # fmt: skip
    glm = make_plan(load_config(GLM, [*over, "--weight_sync.agent", "true"]), hf, Hardware(nodes=96))
    full, agent = glm.sync.paths["full"], glm.sync.paths["agent"]
    assert glm.sync.taken == "agent"
    c = glm.counts
    experts = c.routed + c.routed * 4 // (128 * 128)  # block-FP8 engines: one byte a parameter plus the scales
    assert agent.bytes_per_engine_rank == pytest.approx(full.bytes_per_engine_rank - experts + experts / 32)
    assert agent.bytes_per_engine_rank < 0.1 * full.bytes_per_engine_rank
    assert agent.stall_s > agent.bytes_per_engine_rank / (H2D_GB_S * 1e9)
    assert agent.stall_s < 0.15 * full.stall_s and agent.push_s == pytest.approx(agent.transfer_s + agent.stall_s)
    assert agent.staging_bytes <= (512 + 1024) * 2**20
    qwen = make_plan(load_config(QWEN, ["--weight_sync.agent", "true"]), json.loads(
        (ROOT / "examples/qwen3_30b/hf_config.json").read_text()), Hardware(nodes=6))  # fmt: skip
    assert qwen.sync.paths["agent"].bytes_per_engine_rank == qwen.sync.paths["full"].bytes_per_engine_rank  # EP=1
    assert qwen.sync.paths["agent"].stall_s > qwen.sync.paths["full"].stall_s


def test_the_delta_paths_carry_the_changed_share_and_pay_the_sources_base_copy() -> None:
    """weight_sync.delta: the +delta paths carry the smallest encoding's share of each rank's bytes at the given
    density (FP8 engines: 5 bytes a changed byte below 1/32, so 5 x density), the engines stop as long as without
    deltas (an agent hands over full slices), and the source streams its stage's bases from host memory to the GPU
    bucket by bucket (H2D_GB_S), which bounds the transfer from below; the bases are host memory the plan counts. With
    the agent and weight_sync.delta the config takes agent+delta; delta without an agent does not fit, naming it."""
    from megatron_sao.plan.plan import DELTA_DENSITY, H2D_GB_S, delta_fraction

    hf = json.loads((ROOT / "examples/glm_750b/hf_config.json").read_text())
    glm = make_plan(load_config(GLM, ["--weight_sync.agent", "true", "--weight_sync.delta", "delta"]), hf,
                    Hardware(nodes=96, engine_gpu_mem_gb=141), delta_density=0.002)  # fmt: skip
    s = glm.sync
    agent, delta = s.paths["agent"], s.paths["agent+delta"]
    assert s.taken == "agent+delta" and s.delta_density == 0.002
    assert s.delta_fraction == pytest.approx(0.002 * 5, rel=1e-3) == delta_fraction(0.002, 1)
    assert delta.bytes_per_engine_rank == pytest.approx(agent.bytes_per_engine_rank * s.delta_fraction)
    assert delta.stall_s == agent.stall_s and delta.waits_for_stall
    # each of the 8 stage sources streams at least its stage's bytes (one per FP8 parameter) from host to GPU
    assert delta.host_bytes > glm.counts.total / 8 and delta.transfer_s > glm.counts.total / 8 / (H2D_GB_S * 1e9)
    assert glm.fits, glm.misfits
    default = make_plan(load_config(GLM, []), hf, Hardware(nodes=96, engine_gpu_mem_gb=141))
    assert default.sync.delta_density == DELTA_DENSITY[1] and default.sync.taken == "full"
    bad = make_plan(load_config(GLM, ["--weight_sync.delta", "delta"]), hf, Hardware(nodes=96, engine_gpu_mem_gb=141))
    assert [m.field for m in bad.misfits] == ["weight_sync.delta"]
    assert delta_fraction(0.5, 2) == pytest.approx((1 / 8 + 0.5 * 2) / 2, rel=1e-3)  # bitmap
    assert delta_fraction(0.99, 2) == 1.0  # whole


def test_a_dense_model_plans_without_experts_and_refuses_expert_parallelism(tmp_path: Path) -> None:
    """The dense families (issue 49): Qwen3-8B's config on the Qwen3-30B example's cluster fits with
    parallel.expert 1 (every push path planned, no experts); with the example's expert parallelism the plan names
    parallel.expert, since a dense model has no experts to spread."""
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
          "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000, "tie_word_embeddings": False}  # fmt: skip
    dense = ["--model.family", "qwen3", "--rollout.sglang.ep", "1"]
    plan = make_plan(load_config(QWEN, [*dense, "--parallel.expert", "1"]), hf, Hardware(nodes=6))
    assert plan.fits, plan.misfits
    assert plan.counts.routed == 0 and 8.0e9 < plan.counts.total < 8.4e9
    assert {"full", "sharded", "agent"} <= set(plan.sync.paths)
    bad = make_plan(load_config(QWEN, dense), hf, Hardware(nodes=6))
    assert "parallel.expert" in [m.field for m in bad.misfits], bad.misfits


def test_the_delta_density_is_taken_from_the_command_line_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = plan_cli(capsys, QWEN, "--nodes", "6", "--delta-density", "0.05")
    assert rc == 0 and "deltas at 0.0500 of engine-dtype units changed per push" in " ".join(out.split()), out
    with pytest.raises(SystemExit) as e:
        plan_cli(capsys, QWEN, "--nodes", "6", "--delta-density", "2")
    assert e.value.code == 2 and "--delta-density 2: a share of units, in [0, 1]" in capsys.readouterr().err
