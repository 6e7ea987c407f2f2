"""The dedupe window: what it remembers across generations, and the snapshot a log keeps."""

from __future__ import annotations

from sluice.buffer.dedupe import DedupeWindow


def test_the_newest_half_window_is_always_remembered_and_never_more_than_the_window():
    window = DedupeWindow(8)
    window.add_hashes(range(1, 11))  # generations of 4: {1-4} forgotten, {5-8} previous, {9, 10}
    assert not window.has_hash(4) and all(window.has_hash(h) for h in range(5, 11))
    assert len(window) == 6


def test_the_snapshot_holds_every_remembered_hash_once_oldest_first():
    window = DedupeWindow(8)
    window.add_hashes([7, 3, 3, 9, 1, 12, 5])  # 3 twice: kept once
    assert window.snapshot().tolist() == [7, 3, 9, 1, 12, 5]
    restored = DedupeWindow(8)
    restored.add_hashes(window.snapshot().tolist())
    assert restored.snapshot().tolist() == window.snapshot().tolist()
    assert DedupeWindow(8).snapshot().size == 0
