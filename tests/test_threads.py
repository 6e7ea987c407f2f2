"""The one rule that splits a host's cores between roles (sluice/launch/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sluice.config.loader import load_config
from sluice.launch.threads import plan_threads, role_threads, thread_sleeps

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def planned(cores: int, *overrides: str) -> tuple[int, int]:
    cfg = plan_threads(load_config(QUICKSTART, ["learner.device=cpu", *overrides]), cores)
    return cfg.learner.torch_threads, cfg.rollout.torch_threads


def test_cpu_rollouts_get_one_thread_and_the_learner_the_rest():
    assert planned(2, "rollout.engine=hf") == (1, 1)  # 2 services on 2 cores: never below 1
    assert planned(8, "rollout.engine=hf") == (6, 1)
    assert planned(8, "rollout.engine=hf", "learner.ranks=2") == (3, 1)


def test_sleeping_rollouts_leave_the_learner_all_but_a_core_for_the_shards_and_services():
    assert planned(4, "rollout.engine=sim") == (3, 1)
    assert planned(2, "rollout.engine=sim") == (1, 1)
    assert planned(1, "rollout.engine=sim") == (1, 1)  # never below one


def test_explicit_thread_counts_are_kept():
    assert planned(8, "rollout.engine=hf", "learner.torch_threads=3", "rollout.torch_threads=2") == (3, 2)


def test_a_role_started_alone_takes_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert role_threads("auto") == 3 and role_threads(5) == 5
    monkeypatch.setenv("OMP_NUM_THREADS", "nonsense")
    assert role_threads("auto") >= 1


@pytest.mark.parametrize("bad", ["0", "-1", "lots"])
def test_bad_thread_counts_are_config_errors(bad):
    with pytest.raises(Exception, match="torch_threads"):
        load_config(QUICKSTART, [f"learner.torch_threads={bad}"])


def cores_plan(cores: int, *overrides: str) -> dict[str, dict[str, str]]:
    from sluice.launch.plan import plan_roles
    from sluice.launch.threads import plan_cores

    cfg = plan_threads(load_config(QUICKSTART, ["learner.device=cpu", *overrides]), cores)
    return plan_cores(cfg, plan_roles(cfg), list(range(cores)))


def test_the_learner_trains_on_cores_of_its_own_and_the_rest_yield_to_it():
    plan = cores_plan(2, "rollout.engine=hf")
    assert plan["learner"] == {"SLUICE_CPUS": "1", "SLUICE_COMPUTE_CPUS": "0"}  # helpers on core 1
    assert plan["buffer-0"] == {"SLUICE_PRIORITY": "10"}  # serves: wakes promptly
    assert all(plan[r] == {"SLUICE_PRIORITY": "idle"} for r in ("rollout-0", "rollout-1"))  # computes
    plan = cores_plan(8, "rollout.engine=hf")  # 6 learner threads, 2 cores for its helpers
    assert plan["learner"] == {"SLUICE_CPUS": "6,7", "SLUICE_COMPUTE_CPUS": "0,1,2,3,4,5"}
    plan = cores_plan(4, "rollout.engine=sim")  # sim: the core left is the shards' and helpers'
    assert plan["learner"] == {"SLUICE_CPUS": "3", "SLUICE_COMPUTE_CPUS": "0,1,2"}
    assert all(plan[r] == {"SLUICE_PRIORITY": "10"} for r in ("buffer-0", "rollout-0", "rollout-1"))


def test_nothing_is_placed_when_pinning_is_off():
    assert cores_plan(2, "rollout.engine=hf", "run.pin_cores=false") == {}


@pytest.mark.parametrize(
    ("cores", "overrides"),
    [(4, ("rollout.engine=sim", "learner.torch_threads=4")), (2, ("rollout.engine=hf", "learner.ranks=2"))],
)
def test_where_the_learner_takes_every_core_the_other_roles_still_yield_to_it(cores, overrides):
    plan = cores_plan(cores, *overrides)
    learners = [r for r in plan if r.startswith("learner")]
    # nice 10, not SCHED_IDLE, even for rollouts that compute: with no core outside the
    # learner's training threads, an idle-class service would get nothing for a whole step
    assert learners == [] and plan and all(env == {"SLUICE_PRIORITY": "10"} for env in plan.values())


PINNING_CHILD = """
import os, threading, time
from sluice.launch.threads import SWEEP_EVERY_S, ComputePinning, apply_placement
apply_placement()
stop = threading.Event()
tids = {}
def helper(name):
    tids[name] = threading.get_native_id()
    stop.wait()
before = threading.Thread(target=helper, args=("before",)); before.start()
pinning = ComputePinning()
pinning.pin(1)
after = threading.Thread(target=helper, args=("after",)); after.start()  # inherits the compute core
while len(tids) < 2:
    time.sleep(0.01)
inherited = sorted(os.sched_getaffinity(tids["after"]))
pinning.sweep()
print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(tids["before"])), inherited,
      sorted(os.sched_getaffinity(tids["after"])))
late = threading.Thread(target=helper, args=("late",)); late.start()
while len(tids) < 3:
    time.sleep(0.01)
pinning.sweep()  # looked moments ago: not again before SWEEP_EVERY_S
early = sorted(os.sched_getaffinity(tids["late"]))
time.sleep(SWEEP_EVERY_S)
pinning.sweep()
print(early, sorted(os.sched_getaffinity(tids["late"])))
stop.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_training_thread_is_pinned_and_its_helpers_are_swept_to_the_shared_cores():
    env = {**os.environ, "SLUICE_CPUS": "1", "SLUICE_COMPUTE_CPUS": "0"}
    out = subprocess.run([sys.executable, "-c", PINNING_CHILD], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[0] [1] [0] [1]", "[0] [1]"]


SWAP_CHILD = """
import os, threading, time
from sluice.launch.threads import FULL_SWEEP_EVERY_S, SWEEP_EVERY_S, ComputePinning, apply_placement
apply_placement()
pinning = ComputePinning()
pinning.pin(1)
short = threading.Thread(target=time.sleep, args=(0.3,)); short.start()  # on the compute core
time.sleep(SWEEP_EVERY_S)
pinning.sweep()  # the count moved: listed, the short thread moved
short.join()
stop = threading.Event(); tid = []
swap = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), stop.wait())); swap.start()
while not tid:
    time.sleep(0.01)
time.sleep(SWEEP_EVERY_S)
pinning.sweep()  # one ended, one started: the count is as listed, no listdir
kept = sorted(os.sched_getaffinity(tid[0]))
time.sleep(FULL_SWEEP_EVERY_S)
pinning.sweep()  # a full look, whatever the count
print(kept, sorted(os.sched_getaffinity(tid[0])))
stop.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_thread_started_as_another_ended_is_swept_at_the_next_full_look():
    """The sweep lists the threads only when their count moved, and at least every
    FULL_SWEEP_EVERY_S: a swap that leaves the count equal waits for the full look."""
    env = {**os.environ, "SLUICE_CPUS": "1", "SLUICE_COMPUTE_CPUS": "0"}
    out = subprocess.run([sys.executable, "-c", SWAP_CHILD], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0] [1]"


@pytest.mark.parametrize(("priority", "expected"), [("10", "[10] [0] True"), ("idle", "[0] [5] True")])
def test_a_role_that_yields_runs_every_thread_at_the_lower_priority(priority, expected):
    child = (
        "import os, threading\n"
        "from sluice.launch.threads import apply_placement\n"
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start()\n"
        "apply_placement()\n"
        "after = threading.Thread(target=stop.wait); after.start()  # inherits the priority\n"
        "tids = [int(tid) for tid in os.listdir('/proc/self/task')]\n"
        "print(sorted({os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}),\n"
        "      sorted({os.sched_getscheduler(tid) for tid in tids}), len(tids) >= 3)\n"
        "stop.set()\n"
    )
    assert os.SCHED_IDLE == 5
    env = {**os.environ, "SLUICE_PRIORITY": priority}
    env.pop("SLUICE_CPUS", None)
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == expected


def test_a_bad_priority_is_named():
    env = {**os.environ, "SLUICE_PRIORITY": "low"}
    child = "from sluice.launch.threads import apply_placement; apply_placement()"
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "SLUICE_PRIORITY must be a nice value or 'idle', got 'low'" in out.stderr


def test_thread_sleeps_counts_the_calling_threads_own_waits_only():
    woke = threading.Event()
    before = thread_sleeps()
    waiter = threading.Thread(target=lambda: [woke.wait(0.001) for _ in range(50)])
    waiter.start()
    waiter.join()  # a few sleeps here (start, join), none of the waiter's fifty
    joined = thread_sleeps() - before
    for _ in range(20):
        woke.wait(0.001)
    assert joined < 20
    assert thread_sleeps() - before - joined >= 20
