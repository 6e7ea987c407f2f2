"""The Ray driver's wait for each role's last line (sluice/launch/ray_logs.py), fed through
Ray's own stream dispatcher as its log thread feeds it; no cluster needed."""

from __future__ import annotations

import threading

import pytest

from sluice.launch.ray_logs import ROLE_ENDED, RoleEndWatch, write_role_ended

pytest.importorskip("ray")
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher  # noqa: E402


@pytest.fixture
def watch():
    w = RoleEndWatch()
    assert w.attach()
    yield w
    w.detach()


def test_waits_until_every_role_s_last_line_has_arrived(watch):
    dispatcher.emit({"pid": 11, "lines": [f"{ROLE_ENDED} learner (exit 0)"]})
    timer = threading.Timer(
        0.2, dispatcher.emit, [{"pid": 12, "lines": ["x", f"{ROLE_ENDED} rollout-0 (failed)"]}]
    )
    timer.start()
    try:
        assert watch.wait_for({11, 12}, timeout_s=30) == set()
    finally:
        timer.cancel()


def test_other_lines_do_not_count_and_the_wait_is_bounded(watch):
    dispatcher.emit({"pid": 13, "lines": ["rollout-1 INFO weight receiver: pulled v3"]})
    dispatcher.emit({"pid": 14, "lines": []})
    assert watch.wait_for({13, 14}, timeout_s=0.2) == {13, 14}


def test_a_detached_watch_stops_listening_and_does_not_wait():
    w = RoleEndWatch()
    assert w.attach()
    w.detach()
    dispatcher.emit({"pid": 15, "lines": [f"{ROLE_ENDED} buffer-0 (exit 0)"]})
    assert w.wait_for({15}, timeout_s=30) == {15}  # returns at once: nothing listens


def test_the_last_line_goes_to_stderr_whatever_the_log_level(capfd):
    write_role_ended("rollout-1", "exit 0")
    assert capfd.readouterr().err == f"{ROLE_ENDED} rollout-1 (exit 0)\n"
