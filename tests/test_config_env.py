"""Environment-variable overrides (SLUICE__SECTION__KEY) and role index resolution."""

from __future__ import annotations

import pytest

from sluice.config.loader import ConfigError, env_overrides, load_config
from sluice.launch.role import resolve_index

QUICKSTART = "configs/quickstart.yaml"


def test_env_overrides_nest_by_double_underscore_and_read_yaml():
    env = {
        "SLUICE__LEARNER__LR": "1e-5",
        "SLUICE__WEIGHT_SYNC__MASTER_PORT": "29500",
        "SLUICE__BUFFER__ENDPOINTS": '["tcp://buffer-0:5555"]',
        "SLUICE__workflow__learner__1__loss__IS_CAP": "3",
        "SLUICE_LOG_LEVEL": "DEBUG",  # one underscore: not an override
        "PATH": "/usr/bin",
    }
    cfg = load_config(QUICKSTART, env=env)
    assert cfg.learner.lr == 1e-5
    assert cfg.weight_sync.master_port == 29500
    assert cfg.buffer.endpoints == ["tcp://buffer-0:5555"]
    assert cfg.workflow is not None and cfg.workflow.learner[1].loss.is_cap == 3.0
    assert [p for p, _, _ in env_overrides(env)] == [
        ["buffer", "endpoints"],
        ["learner", "lr"],
        ["weight_sync", "master_port"],
        ["workflow", "learner", "1", "loss", "is_cap"],
    ]


def test_precedence_file_then_env_then_command_line():
    env = {"SLUICE__LEARNER__LR": "1e-5", "SLUICE__LEARNER__TOTAL_STEPS": "7"}
    cfg = load_config(QUICKSTART, ["learner.lr=2e-5"], env=env)
    assert cfg.learner.lr == 2e-5  # command line beats the environment
    assert cfg.learner.total_steps == 7  # the environment beats the file (300)
    assert load_config(QUICKSTART).learner.total_steps == 300  # no env unless asked for


def test_bad_env_value_names_key_and_variable():
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, env={"SLUICE__BUFFER__SHARDS": "many"})
    msg = str(e.value)
    assert "buffer.shards" in msg and "SLUICE__BUFFER__SHARDS" in msg and "\n" not in msg
    with pytest.raises(
        ConfigError, match=r"learner.lerning_rate: unknown key \[from SLUICE__LEARNER__LERNING_RATE\]"
    ):
        load_config(QUICKSTART, env={"SLUICE__LEARNER__LERNING_RATE": "1"})
    with pytest.raises(ConfigError, match="SLUICE__LEARNER____LR: expected SLUICE__SECTION__KEY"):
        load_config(QUICKSTART, env={"SLUICE__LEARNER____LR": "1"})
    with pytest.raises(ConfigError, match="SLUICE__LEARNER__LR__X: learner.lr is not a section"):
        load_config(QUICKSTART, env={"SLUICE__LEARNER__LR__X": "1"})


def test_command_line_fix_of_a_bad_env_value_is_not_blamed_on_the_variable():
    cfg = load_config(QUICKSTART, ["buffer.shards=2"], env={"SLUICE__BUFFER__SHARDS": "many"})
    assert cfg.buffer.shards == 2
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, ["buffer.shards=x"], env={"SLUICE__BUFFER__SHARDS": "1"})
    assert "SLUICE__" not in str(e.value)


def test_security_needs_a_key_directory():
    with pytest.raises(ConfigError, match="security: .*keys_dir is not set"):
        load_config(QUICKSTART, ["security.curve=true"])


def test_ray_resources_are_checked():
    with pytest.raises(ConfigError, match="ray.rollout.num_gpus"):
        load_config(QUICKSTART, ["ray.rollout.num_gpus=-1"])
    with pytest.raises(ConfigError, match="ray.strategy"):
        load_config(QUICKSTART, ["ray.strategy=EVERYWHERE"])
    cfg = load_config(QUICKSTART, ["ray.rollout.resources={NPU: 1}", "ray.learner.num_gpus=1"])
    assert cfg.ray.rollout.resources == {"NPU": 1.0} and cfg.ray.learner.num_gpus == 1.0


@pytest.mark.parametrize(
    ("explicit", "env", "expected"),
    [
        (3, {"SLUICE_INDEX": "1"}, 3),
        (None, {"SLUICE_INDEX": "1", "SLURM_PROCID": "2"}, 1),
        (None, {"SLURM_PROCID": "2", "JOB_COMPLETION_INDEX": "5"}, 2),
        (None, {"JOB_COMPLETION_INDEX": "5"}, 5),
        (None, {}, 0),
    ],
)
def test_role_index_from_option_or_scheduler(explicit, env, expected):
    assert resolve_index(explicit, env) == expected


def test_role_index_errors_name_the_variable():
    with pytest.raises(ConfigError, match="SLURM_PROCID='x'"):
        resolve_index(None, {"SLURM_PROCID": "x"})
    with pytest.raises(ConfigError, match="index -1"):
        resolve_index(-1, {})
