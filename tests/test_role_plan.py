"""The role plan (sluice/launch/plan.py): what processes a config needs, the same for every
launcher, and the per-role commands that run one of them."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.runs import ROOT

from sluice.config import load_config
from sluice.config.learner import GroupPorts
from sluice.launch.plan import find_spec, plan_roles, what_next
from sluice.launch.ray_launcher import plan_resources
from sluice.launch.ray_node_loss import handling_rank

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
CARTPOLE = ROOT / "configs" / "cartpole.yaml"


def names(cfg) -> list[str]:
    return [s.name for s in plan_roles(cfg)]


def test_the_quickstart_plan():
    specs = plan_roles(load_config(QUICKSTART))
    assert [s.name for s in specs] == ["buffer-0", "learner", "rollout-0", "rollout-1"]
    assert [s.args for s in specs] == [
        ["buffer", "--shard", "0"],
        ["learner", "--policy", "default"],
        ["rollout", "--index", "0"],
        ["rollout", "--index", "1"],
    ]
    assert [s.max_restarts for s in specs] == [3, 0, 3, 3]  # buffer.max_restarts (durable), rollout
    assert [s.exits_with_run for s in specs] == [False, True, True, True]
    assert all(not s.env for s in specs)  # a group of one needs no torchrun variables


def test_a_learner_group_of_two_ranks_and_its_rendezvous():
    cfg = load_config(QUICKSTART, ["learner.ranks=2", "learner.master_port=29511", "buffer.shards=2"])
    assert names(cfg) == ["buffer-0", "buffer-1", "learner", "learner-r1", "rollout-0", "rollout-1"]
    r0, r1 = (s for s in plan_roles(cfg) if s.kind == "learner")
    assert r1.env == {
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511",
    }  # fmt: skip
    assert r0.env["RANK"] == "0" and r0.group_rank == 0 and r1.group_rank == 1


def test_two_policies_each_with_its_group_and_services():
    cfg = load_config(CARTPOLE, ["learner.policies=[a, b]", "rollout.services=3"])
    cfg.learner.group_ports["b"] = GroupPorts(control=1, weight_sync=2, dist=3, host="10.0.0.2")
    specs = plan_roles(cfg)
    assert [s.name for s in specs] == [
        "buffer-0",
        "learner",
        "learner-b",
        "rollout-0",
        "rollout-1",
        "rollout-2",
    ]
    assert [s.policy for s in specs if s.kind == "rollout"] == ["a", "b", "a"]
    assert [s.policy for s in specs if s.kind == "learner"] == ["a", "b"]
    many = load_config(CARTPOLE, ["learner.policies=[a, b]", "learner.ranks=2"])
    many.learner.group_ports["b"] = cfg.learner.group_ports["b"]
    b1 = find_spec(many, "learner", 1, "b")
    assert b1.name == "learner-b-r1" and b1.env["MASTER_ADDR"] == "10.0.0.2" and b1.env["MASTER_PORT"] == "3"


def test_resources_are_summed_over_the_plan():
    cfg = load_config(QUICKSTART, ["ray.rollout.num_cpus=0.5", "ray.learner.num_gpus=1", "learner.ranks=2"])
    assert plan_resources(plan_roles(cfg)) == {"CPU": 1 + 2 + 2 * 0.5, "GPU": 2}


def test_find_spec_refuses_what_the_config_does_not_have():
    cfg = load_config(QUICKSTART)
    with pytest.raises(ValueError, match=r"no buffer 3 in this config \(buffer.shards\)"):
        find_spec(cfg, "buffer", 3)
    with pytest.raises(
        ValueError, match=r"no learner 1 of policy 'default' in this config \(learner.ranks\)"
    ):
        find_spec(cfg, "learner", 1)
    joining = find_spec(cfg, "rollout", 5)  # a service beyond rollout.services joins (scale-out)
    assert joining.name == "rollout-5" and joining.args == ["rollout", "--index", "5"]
    assert joining.max_restarts == 3


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["buffer", str(QUICKSTART), "--shard", "3"],
            "config error: no buffer 3 in this config (buffer.shards)",
        ),
        (
            ["learner", str(QUICKSTART), "--policy", "nope"],
            "config error: --policy: 'nope' is not in learner.policies",
        ),
    ],
)
def test_a_per_role_command_outside_the_plan_is_a_config_error(args, expected):
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith(expected), proc.stderr[-2000:]


def test_a_role_that_is_not_restarted_says_why_and_what_to_do(tmp_path):
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "learner.checkpoint_every=10"])
    buffer, learner, rollout, _ = plan_roles(cfg)
    assert "learner.checkpoint_every > 0" in what_next(cfg, learner, 0, -9)  # nothing to resume from
    (tmp_path / "checkpoints" / "step_000020").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").symlink_to("step_000020")
    hint = what_next(cfg, learner, 2, -9)
    assert (
        "learner.max_restarts=2 used up" in hint and "step_000020" in hint and "learner.resume=auto" in hint
    )
    assert "buffer.max_restarts=3 used up" in what_next(cfg, buffer, 3, -9)
    assert "rollout.max_restarts=3 used up" in what_next(cfg, rollout, 3, 1)
    assert "fail the same way" in what_next(cfg, rollout, 0, 3)  # a user's code raised
    memory = load_config(QUICKSTART, [f"run.dir={tmp_path}", "buffer.durable=false"])
    assert "buffer.durable: false" in what_next(memory, plan_roles(memory)[0], 0, -9)


def test_roles_that_ended_together_are_handled_shards_then_learners_then_rollouts():
    # one lost node with a shard and a learner: the shard's move restarts the learner group
    # once, with the new address (handled the other way round, the group would restart twice)
    cfg = load_config(QUICKSTART, ["buffer.shards=2", "learner.ranks=2"])
    kinds = sorted((spec.kind for spec in reversed(plan_roles(cfg))), key=handling_rank)
    assert kinds == ["buffer"] * 2 + ["learner"] * 2 + ["rollout"] * cfg.rollout.services
