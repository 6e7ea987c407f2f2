"""Learner groups of K ranks: the update equals one process's update on the whole batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers.procs import child_env
from safetensors.torch import load_file

from sluice.net import free_port

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "helpers" / "group_step.py"


def write_config(path: Path, run_dir: Path, workflow: str | None = None, **learner) -> Path:
    cfg: dict = {
        "run": {"dir": str(run_dir), "seed": 0},
        "model": {
            "init": {
                "vocab": "digits",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_layers": 1,
                "num_heads": 2,
                "head_dim": 16,
                "seed": 3,
            }
        },
        "learner": {
            "lr": 1e-2,
            "loss": {"type": "decoupled_ppo", "clip_low": 0.2, "clip_high": 0.28},
            "grad_clip": 100.0,
            **learner,
        },
    }
    if workflow is not None:  # the workflow says what the loss is
        del cfg["learner"]["loss"]
        cfg["workflow"] = workflow
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_group(tmp: Path, name: str, ranks: int, *worker_args: str, **learner) -> tuple[dict, list]:
    out = tmp / name
    out.mkdir()
    config = write_config(tmp / f"{name}.yaml", tmp / f"run-{name}", ranks=ranks, **learner)
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = child_env(OMP_NUM_THREADS="1")
        if ranks > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(config), str(out), *worker_args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        )
    try:
        for p in procs:
            text = p.communicate(timeout=300)[0].decode(errors="replace")
            assert p.returncode == 0, text[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return load_file(str(out / "params.safetensors")), json.loads((out / "stats.json").read_text())


def assert_same_update(
    a: tuple[dict, list],
    b: tuple[dict, list],
    tol: float,
    keys: tuple[str, ...] = (),
    param_tol: float | None = None,
) -> None:
    """Same statistics (the gradient norm is the scale-sensitive one: Adam's update is nearly
    invariant to a gradient scale) and the same parameters after the steps (within `param_tol`,
    default `tol`)."""
    (pa, sa), (pb, sb) = a, b
    for step_a, step_b in zip(sa, sb):
        for key in ("grad_norm", "policy_loss", "clip_frac", *(keys or ("is_weight_mean",))):
            assert abs(step_a[key] - step_b[key]) <= tol * max(1.0, abs(step_a[key])), (
                key,
                step_a[key],
                step_b[key],
            )
    assert pa.keys() == pb.keys()
    worst = max(float((pa[k] - pb[k]).abs().max()) for k in pa)
    assert worst < (tol if param_tol is None else param_tol), f"max |param diff| {worst}"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[dict, list]:
    """The reference: one process, the whole batch, no accumulation."""
    return run_group(tmp_path_factory.mktemp("single"), "single", ranks=1)


@pytest.mark.slow
def test_ddp_two_ranks_equals_one_rank_on_the_whole_batch(tmp_path, single):
    """Two learner steps (the second Adam step depends on gradient magnitudes, not only signs):
    2 DDP ranks with 2 micro-batches each == 1 process on the concatenated batch."""
    ddp = run_group(tmp_path, "ddp", ranks=2, micro_batches=2)
    assert_same_update(single, ddp, tol=1e-5)
    # and the steps moved the weights: the comparison is not of two untouched models
    initial = load_file(str(tmp_path / "run-ddp" / "model" / "model.safetensors"))
    assert max(float((single[0][k] - initial[k]).abs().max()) for k in initial) > 1e-3


@pytest.mark.slow
def test_ddp_ranks_that_leave_out_rows_without_advantage_equal_one_rank(tmp_path):
    """Groups that scored alike are left out of the step (`learner.skip_zero_advantage`): in the
    first step all of one rank's groups (it computes a dummy piece while the other trains), in
    the second every group. Two ranks == one process, and == one process computing every row.
    Parameters within 1% of one Adam step, as for the critic below: the second step has no
    gradient, so Adam moves each weight by its first moments over sqrt(v) + eps, which for a
    weight whose first gradient was near 0 turns summation order into ~1e-5 (seen: 1.0e-5 with
    every row computed, 2.5e-5 leaving rows out)."""
    one = run_group(tmp_path, "one", 1, "--alike")
    two = run_group(tmp_path, "two", 2, "--alike", micro_batches=2)
    assert_same_update(one, two, tol=1e-5, param_tol=1e-4)
    assert [step["inert_frac"] for step in two[1]] == [pytest.approx(one[1][0]["inert_frac"]), 1.0]
    assert 0.0 < one[1][0]["inert_frac"] < 1.0
    whole = run_group(tmp_path, "whole", 1, "--alike", skip_zero_advantage=False)
    assert_same_update(one, whole, tol=1e-5, keys=("grad_norm",), param_tol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_two_ranks_equals_one_rank_on_the_whole_batch(tmp_path, single, stage):
    """ZeRO-2 partitions gradients and optimizer state; ZeRO-3 the parameters too (gathered for
    the result)."""
    zero = run_group(
        tmp_path, f"zero{stage}", ranks=2, micro_batches=2, backend="deepspeed", zero_stage=stage
    )
    assert_same_update(single, zero, tol=1e-5)


@pytest.mark.slow
def test_a_critic_trained_by_two_ranks_equals_one_rank(tmp_path):
    """ppo_critic: the value model's gradients (averaged over ranks after the world-size-scaled
    backward) give the one-process update; its second-step values shape the policy's GAE
    advantages, so the policy's parameters check the critic's first update too."""
    one = run_group(tmp_path, "one", ranks=1, workflow="ppo_critic")
    two = run_group(tmp_path, "two", ranks=2, micro_batches=2, workflow="ppo_critic")
    # Parameters within 1% of one Adam step (lr 1e-2): a critic weight whose gradient is near 0
    # moves by lr * g / (|g| + eps), which turns the ranks' different summation order into
    # differences of ~1e-5 (seen: 1.1e-5). A missing or doubled gradient share moves it by ~lr,
    # and the statistics above (critic_grad_norm to 1e-5) catch any gradient scale.
    assert_same_update(one, two, tol=1e-5, keys=("value_loss", "critic_grad_norm"), param_tol=1e-4)
    assert all(step["critic_grad_norm"] > 0 for step in one[1])
