"""Start-up objects leave the garbage collector's full passes, and freed memory stays with the
process for its next step (sluice/launch/heap.py)."""

from __future__ import annotations

import gc
import subprocess
import sys
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
    # frozen objects are still freed when their last reference goes (another thread's, here
    # pytest-xdist's): the count can only shrink after the freeze (one CI run: 686,310 -> 686,308)
    assert frozen >= len(built) and len(built) <= gc.get_freeze_count() <= frozen
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
    monkeypatch.setattr(actor, "retain_freed_memory", lambda: calls.append("retained"))

    class Loop:
        def run(self) -> int:
            calls.append("run")
            return 0

        def close(self) -> None:
            calls.append("closed")

    assert actor.run_actor(Loop()) == 0  # type: ignore[arg-type]
    assert calls == ["placed", "frozen", "retained", "run", "closed"]


# A step's pattern: 128 blocks of 1 MiB (more than TOP_PAD alone keeps) malloc'd, written and
# freed. Prints the minor page faults of the last of 5 such steps, before and after
# retain_freed_memory (a fresh process: mallopt changes the whole process).
STEPS = """
import ctypes, ctypes.util, resource
from sluice.launch.heap import retain_freed_memory

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def faults_of_a_step():
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(2**20) for _ in range(128)]
        for block in blocks:
            ctypes.memset(block, 1, 2**20)
        for block in reversed(blocks):
            libc.free(block)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    return faults

default = faults_of_a_step()
assert retain_freed_memory(), "mallopt refused a setting"
print(default, faults_of_a_step())
"""


def test_a_step_that_frees_its_blocks_gets_them_back_without_faulting_its_pages_in_again():
    out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    default, retained = map(int, out.stdout.split())
    assert default >= 128 * 256 / 2  # glibc's default gives the 128 MiB back: faulted in each step
    assert retained < 128 * 256 / 50  # kept: the next step reuses its pages
