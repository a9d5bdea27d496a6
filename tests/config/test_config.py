"""The config tree: loading, overrides, and an error naming the field and the fix for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_sao.config import ConfigError, SAOConfig, config_to_yaml, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for ext in ("*.yaml", "*.yml", "*.toml") for p in (ROOT / "examples").rglob(ext))


def test_defaults_are_the_paper_hyperparameters():
    cfg = load_config()
    assert cfg.algo.dis.eps_low == 0.3 and cfg.algo.dis.eps_high == 5.0
    assert cfg.algo.value.updates_per_policy_step == 2
    assert cfg.algo.gae.alpha == 1.5 and cfg.algo.gae.lambda_critic == 1.0 and cfg.algo.gae.gamma == 1.0
    assert cfg.learner.policy.lr == 1e-6 and cfg.learner.value.lr == 5e-6 and cfg.learner.value.warmup_steps == 10
    assert cfg.learner.trajectories_per_step == 128


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, SAOConfig)


def test_examples_ship_configs_for_each_target():
    names = {p.parent.name for p in SHIPPED}
    assert {"qwen3_30b", "glm_750b", "tiny_cpu"} <= names


def test_dotted_overrides_both_spellings_and_yaml_values():
    cfg = load_config(
        None,
        [
            "--algo.dis.eps_high",
            "3.0",
            "--learner.seed=7",
            "--model.hf_overrides",
            "{num_hidden_layers: 2}",
            "--parallel.sequence_parallel",
            "null",
        ],
    )
    assert cfg.algo.dis.eps_high == 3.0 and cfg.learner.seed == 7
    assert cfg.model.hf_overrides == {"num_hidden_layers": 2}
    assert cfg.parallel.sequence_parallel is None


def test_yaml_and_toml_load_the_same_tree(tmp_path):
    (tmp_path / "a.yaml").write_text("algo:\n  dis:\n    eps_low: 0.8\nlearner:\n  seed: 3\n")
    (tmp_path / "a.toml").write_text("[algo.dis]\neps_low = 0.8\n[learner]\nseed = 3\n")
    assert load_config(tmp_path / "a.yaml") == load_config(tmp_path / "a.toml")


def test_yaml_dump_round_trips(tmp_path):
    cfg = load_config(None, ["--algo.name", "grpo", "--parallel.expert", "2", "--launch.nproc_per_node", "2"])
    (tmp_path / "c.yaml").write_text(config_to_yaml(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    return str(e.value)


def test_unknown_key_suggests_the_closest_field():
    msg = _error("--algo.dis.eps_hgh", "3")
    assert "algo.dis.eps_hgh: unknown key" in msg and "did you mean 'algo.dis.eps_high'" in msg


def test_unknown_section_suggests_the_closest_section():
    assert "did you mean 'learner'" in _error("--lerner.seed", "3")


def test_unknown_key_without_a_close_match_lists_the_known_keys():
    msg = _error("--bus.zzzz", "1")
    assert "bus.zzzz: unknown key" in msg and "max_inflight" in msg


def test_world_size_not_divisible_by_tp_pp_cp():
    msg = _error("--launch.nproc_per_node", "6", "--parallel.tensor", "4")
    assert "world size 6 is not divisible by parallel.tensor * parallel.pipeline * parallel.context" in msg
    assert "4*1*1 = 4" in msg


def test_world_size_not_divisible_by_pipeline_and_context():
    msg = _error("--launch.nproc_per_node", "4", "--parallel.pipeline", "3")
    assert "world size 4" in msg and "1*3*1 = 3" in msg


def test_expert_parallel_must_divide_the_expert_count():
    msg = _error("--model.num_experts", "6", "--parallel.expert", "4", "--launch.nproc_per_node", "4")
    assert "parallel.expert=4 does not divide the model's 6 routed experts" in msg and "[1, 2, 3, 6]" in msg


def test_expert_count_is_read_from_the_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 10}))
    msg = _error("--model.hf_path", str(tmp_path), "--parallel.expert", "4", "--launch.nproc_per_node", "4")
    assert "10 routed experts" in msg


def test_expert_layout_must_fit_the_world():
    msg = _error("--parallel.expert", "4", "--launch.nproc_per_node", "2")
    assert "parallel.expert * parallel.expert_tensor * parallel.pipeline" in msg


def test_sequence_parallel_without_tensor_parallel_is_refused():
    assert "needs parallel.tensor > 1" in _error("--parallel.sequence_parallel", "true")


def test_out_of_range_and_mistyped_values_name_the_field():
    assert "algo.dis.eps_low" in _error("--algo.dis.eps_low", "1.5")
    assert "learner.seed" in _error("--learner.seed", "abc")
    assert "algo.name" in _error("--algo.name", "ppo")


def test_cross_section_token_limits():
    msg = _error("--rollout.max_total_tokens", "9000", "--model.max_seq_len", "8192")
    assert "rollout.max_total_tokens=9000 exceeds model.max_seq_len=8192" in msg


def test_sao_without_critic_updates_is_refused():
    assert "algo.value.updates_per_policy_step=0" in _error("--algo.value.updates_per_policy_step", "0")


def test_an_update_group_timeout_inside_the_bucket_timeout_is_refused():
    message = _error("--weight_sync.bucket_timeout_s", "300", "--weight_sync.group_timeout_s", "300")
    assert "weight_sync.group_timeout_s=300" in message and "weight_sync.bucket_timeout_s" in message


def test_online_fp8_quantization_of_engines_that_take_pushes_is_refused():
    message = _error("--rollout.engine", "sglang", "--rollout.sglang.extra_args", '["--quantization", "fp8"]')
    assert "rollout.sglang.extra_args has --quantization but rollout.model_path is not set" in message
    cfg = load_config(None, ["--rollout.engine", "sglang", "--rollout.sglang.extra_args", '["--quantization", "fp8"]',
                             "--rollout.model_path", "/ckpt/Model-FP8"])  # fmt: skip
    assert cfg.engine_model_path == "/ckpt/Model-FP8"


def test_malformed_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="has no value"):
        parse_overrides(["--algo.dis.eps_low"])
    with pytest.raises(ConfigError, match="must look like"):
        parse_overrides(["algo.dis.eps_low=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("algo: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ConfigError, match="unknown extension"):
        load_config(tmp_path / "x.json")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["--learner.seed", "1", "--learner.seed.x", "2"])


@pytest.mark.multiproc
def test_cli_config_show_prints_the_resolved_tree_and_check_exits_2_on_errors():
    run = [sys.executable, "-m", "megatron_sao", "config"]
    out = subprocess.run([*run, "show", "--algo.dis.eps_high", "4.5"], capture_output=True, text=True, check=True)
    assert "eps_high: 4.5" in out.stdout
    bad = subprocess.run([*run, "check", "--algo.dis.eps_hihg", "4.5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "did you mean 'algo.dis.eps_high'" in bad.stderr


def test_partial_role_override_keeps_the_role_defaults():
    cfg = load_config(None, ["--learner.value.lr", "1e-3", "--learner.policy.warmup_steps", "5"])
    assert cfg.learner.value.lr == 1e-3 and cfg.learner.value.warmup_steps == 10
    assert "*.self_attention.*" in cfg.learner.value.frozen and "output_layer.*" in cfg.learner.value.trainable
    assert cfg.learner.policy.lr == 1e-6 and cfg.learner.policy.warmup_steps == 5


def test_model_family_choices_are_the_registry() -> None:
    """config/model.py spells the family names as a Literal (the config stays import-light); they must be
    exactly the families models/families registers."""
    from typing import get_args

    from megatron_sao.config.model import ModelFamily
    from megatron_sao.models.families import FAMILIES

    assert set(get_args(ModelFamily)) == set(FAMILIES)


@pytest.mark.parametrize(
    ("layers", "pp", "split"),
    [(48, 4, (None, None)), (78, 8, (9, 9)), (3, 2, (1, 2)), (7, 4, (1, 2)), (61, 4, (14, 15)), (5, 1, (None, None))],
)
def test_pipeline_split_is_even_or_balanced(layers: int, pp: int, split: tuple) -> None:
    from megatron_sao.config import ParallelConfig

    first, last = ParallelConfig(pipeline=pp).stage_layers(layers)
    assert (first, last) == split
    if first is not None:
        middle = (layers - first - last) // (pp - 2) if pp > 2 else max(first, last)
        assert first + last + middle * (pp - 2) == layers and 1 <= first <= middle and last <= middle


def test_pipeline_split_errors_name_the_fields() -> None:
    from megatron_sao.config import ParallelConfig

    assert ParallelConfig(pipeline=4, first_stage_layers=4, last_stage_layers=4).stage_layers(12) == (4, 4)
    with pytest.raises(ValueError, match="first_stage_layers=5 / last_stage_layers=None leave 7"):
        ParallelConfig(pipeline=4, first_stage_layers=5).stage_layers(12)
    with pytest.raises(ValueError, match="cannot be split over parallel.pipeline=4"):
        ParallelConfig(pipeline=4).stage_layers(3)
    with pytest.raises(ValueError, match="need parallel.pipeline > 1"):
        ParallelConfig(first_stage_layers=2).stage_layers(4)


def test_routing_replay_asks_the_engines_for_routes_and_refuses_a_dense_model(tmp_path):
    from megatron_sao.engines.sglang_launcher import embedded_command, sglang_command

    moe = ROOT / "examples" / "qwen3_30b" / "hf_config.json"
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(moe.read_text())
    cfg = load_config(None, [f"--model.hf_path={tmp_path / 'moe'}", "--learner.routing_replay=true"])
    assert cfg.rollout.return_routed_experts
    assert "--enable-return-routed-experts" in sglang_command(cfg.rollout, "m", 0, "h")
    assert "--enable-return-routed-experts" in embedded_command(cfg.rollout, "m", 0, "h")
    assert "--enable-return-routed-experts" not in embedded_command(load_config().rollout, "m", 0, "h")
    dense = {k: v for k, v in json.loads(moe.read_text()).items() if k not in ("num_experts", "num_local_experts")}
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps(dense))
    with pytest.raises(ConfigError, match="learner.routing_replay=true but .* is a dense model"):
        load_config(None, [f"--model.hf_path={tmp_path / 'dense'}", "--learner.routing_replay=true"])


def test_critic_routing_replay_needs_the_routes_a_critic_and_the_policy_s_ranks():
    on = ["--learner.critic_routing_replay=true"]
    with pytest.raises(ConfigError, match="critic_routing_replay=true needs learner.routing_replay=true"):
        load_config(None, on)
    with pytest.raises(ConfigError, match="algo.name=grpo has no critic"):
        load_config(None, [*on, "--learner.routing_replay=true", "--algo.name=grpo"])
    with pytest.raises(ConfigError, match="value job receives no routes"):
        load_config(None, [*on, "--learner.routing_replay=true", "--learner.value_on_separate_ranks=true"])
    assert load_config(None, [*on, "--learner.routing_replay=true"]).learner.critic_routing_replay


def test_router_url_must_be_an_http_url():
    assert load_config(None, ["--rollout.router_url", "http://10.0.0.1:30000"]).rollout.router_url
    with pytest.raises(ConfigError, match="rollout.router_url='10.0.0.1:30000' must be an http"):
        load_config(None, ["--rollout.router_url", "10.0.0.1:30000"])


@pytest.mark.parametrize(
    ("override", "value", "words"),
    [
        ("learner.max_steps", "true", "boolean"),
        ("learner.policy.lr", "inf", "finite"),
        ("rollout.sampling.temperature", "nan", "finite"),
    ],
)
def test_a_boolean_or_non_finite_number_is_refused_naming_the_field(override: str, value: str, words: str) -> None:
    """Issue 31, item 5: `--learner.max_steps true` was taken as 1, and inf passed as a learning rate."""
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu" / "config.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(example, [f"--{override}", value])
    assert override.rsplit(".", 1)[1] in str(e.value) and words in str(e.value).lower(), str(e.value)


def test_every_config_field_says_what_it_does() -> None:
    """Each field of every section (nested and optional ones included) has a docstring: `config show` and the docs
    read them, and a field without one is a question for every user."""
    import typing

    from pydantic import BaseModel

    from megatron_sao.config.tree import SAOConfig

    def sections(annotation: object) -> list[type[BaseModel]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [s for arg in typing.get_args(annotation) for s in sections(arg)]

    missing: list[str] = []

    def walk(cls: type[BaseModel], prefix: str) -> None:
        for name, f in cls.model_fields.items():
            subs = sections(f.annotation)
            if not f.description and not subs:
                missing.append(prefix + name)
            for sub in subs:
                walk(sub, f"{prefix}{name}.")

    walk(SAOConfig, "")
    assert not missing, f"config fields without a docstring: {missing}"


def test_a_save_interval_producers_cannot_hold_is_refused() -> None:
    """bus.max_uncommitted below trajectories_per_step x save_interval x (fallback_checkpoints + 1): a producer
    would block before the learner could checkpoint what it holds (the run stalled silently); refused, naming the
    fields and the number that fits."""
    from megatron_sao.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"bus.max_uncommitted=65536 .* = 102400.*at least 102400"):
        load_config(None, ["--learner.trajectories_per_step", "1024", "--learner.save_interval", "50"])
    load_config(None, ["--learner.trajectories_per_step", "1024", "--learner.save_interval", "50",
                       "--bus.max_uncommitted", "102400"])  # fmt: skip
