"""Start-up objects leave the garbage collector's full passes (sluice/launch/heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from sluice.launch.heap import freeze_startup_heap
from sluice.rollout_svc import actor


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_what_the_role_built_is_frozen_and_later_cycles_are_still_collected(unfrozen):
    built = [{"weights": i} for i in range(1000)]
    frozen = freeze_startup_heap()
    assert frozen >= len(built) and gc.get_freeze_count() == frozen
    tracked = {id(o) for o in gc.get_objects()}  # generations 0-2: what a full pass walks
    assert not any(id(o) in tracked for o in built)

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle made while serving: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None


def test_freezing_again_takes_in_what_was_made_since(unfrozen):
    first = freeze_startup_heap()
    more = [[i] for i in range(500)]
    assert freeze_startup_heap() >= first + len(more)


def test_a_rollout_service_freezes_its_heap_once_built_before_its_loop(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(actor, "apply_placement", lambda: calls.append("placed"))
    monkeypatch.setattr(actor, "freeze_startup_heap", lambda: calls.append("frozen"))

    class Loop:
        def run(self) -> int:
            calls.append("run")
            return 0

        def close(self) -> None:
            calls.append("closed")

    assert actor.run_actor(Loop()) == 0  # type: ignore[arg-type]
    assert calls == ["placed", "frozen", "run", "closed"]
