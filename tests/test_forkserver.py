"""`sluice run`'s fork server (sluice/launch/forkserver.py): which roles it forks, and that a
forked role is the process a spawned one is: its own session, the environment it was given,
its log, its exit code (a signal's too), and a server that goes when the launcher closes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest
from helpers.procs import child_env
from helpers.wait import wait_until

from sluice.accelerators import cpu_only
from sluice.config.loader import load_config
from sluice.launch.forkserver import RoleForker, forked, uses_forkserver
from sluice.launch.plan import plan_roles, rollout_spec

QUICKSTART = "configs/quickstart.yaml"


@pytest.mark.parametrize("method", ["auto", "forkserver", "spawn"])
def test_the_start_method_picks_which_roles_are_forked(method):
    cfg = load_config(QUICKSTART, [f"run.start_method={method}"])
    on = {"auto": cpu_only() and os.uname().sysname == "Linux", "forkserver": True, "spawn": False}[method]
    assert uses_forkserver(cfg) is on
    kinds = {spec.kind: forked(cfg, spec) for spec in plan_roles(cfg)}
    assert kinds == {"buffer": False, "learner": on, "rollout": on}  # shards: always spawned
    vllm = load_config(QUICKSTART, [f"run.start_method={method}", "rollout.engine=vllm"])
    assert not forked(vllm, rollout_spec(vllm, 0))  # vLLM starts processes of its own


def test_a_forked_role_is_its_own_process_with_its_env_log_and_exit_code(tmp_path):
    forker, started = RoleForker(), []
    try:
        # a bad config: the CLI's exit code 2 and its one-line error, in the role's log
        bad_log = tmp_path / "bad.log"
        bad = forker.start(["buffer", "--shard", "0", str(tmp_path / "missing.yaml")], child_env(), bad_log)
        started.append(bad)
        assert bad.wait(timeout=120) == 2 and bad.returncode == 2
        assert "missing.yaml" in bad_log.read_text()

        # a shard that serves until killed, configured by the environment it was given alone
        log_path = tmp_path / "buffer-0.log"
        env = child_env(
            SLUICE__RUN__DIR=str(tmp_path),
            SLUICE__BUFFER__ENDPOINTS=json.dumps(["tcp://127.0.0.1:*"]),
            SLUICE_DIE_WITH_PARENT="1",  # as the launcher sets it: gone with the server
        )
        shard = forker.start(["buffer", "--shard", "0", QUICKSTART], env, log_path)
        started.append(shard)
        record = tmp_path / "endpoints" / "buffer-0.json"
        wait_until(
            record.exists, 60, lambda: f"the shard's endpoint record; log: {log_path.read_text()[-1500:]}"
        )
        assert json.loads(record.read_text())["pid"] == shard.pid
        assert os.getsid(shard.pid) == shard.pid  # a session and process group of its own
        assert "-m sluice.cli buffer --shard 0" in " ".join(psutil.Process(shard.pid).cmdline())
        wait_until(lambda: "serving at" in log_path.read_text(), 30, "its log line")
        assert shard.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            shard.wait(timeout=0.1)
        os.killpg(shard.pid, signal.SIGKILL)
        assert shard.wait(timeout=30) == -signal.SIGKILL
    finally:
        for role in started:
            if role.poll() is None:
                os.killpg(role.pid, signal.SIGKILL)
        forker.close()
    servers = [
        p for p in psutil.Process().children() if "multiprocessing.forkserver" in " ".join(p.cmdline())
    ]
    assert not servers, "the fork server outlived close()"
