"""The local launcher's reader of the learner's metrics file, across a resume that rewrites it."""

from __future__ import annotations

import json
import os

from sluice.launch.local import Tail


def write(path, versions, mode="w") -> None:
    with path.open(mode) as fh:
        fh.writelines(json.dumps({"version": v}) + "\n" for v in versions)


def test_tail_reads_complete_lines_as_they_come(tmp_path):
    path = tmp_path / "learner.jsonl"
    tail = Tail(path)
    assert tail.poll() == []  # no file yet
    write(path, [1, 2])
    with path.open("a") as fh:
        fh.write('{"version": 3')  # a line still being written
    assert [r["version"] for r in tail.poll()] == [1, 2]
    with path.open("a") as fh:
        fh.write("}\n")
    assert [r["version"] for r in tail.poll()] == [3] and tail.last == {"version": 3}


def test_a_resumed_learner_rewriting_its_file_shorter_is_read_again_from_the_start(tmp_path):
    """What learner/metrics.py does on resume: the records up to the checkpoint, written to a
    new file that replaces the old one. The old offset falls inside a line of the new file."""
    path = tmp_path / "learner.jsonl"
    write(path, range(1, 31))
    tail = Tail(path)
    assert len(tail.poll()) == 30
    tmp = tmp_path / "tmp"
    write(tmp, range(1, 11))
    os.replace(tmp, path)
    write(path, [11, 12], mode="a")  # the resumed learner goes on
    assert [r["version"] for r in tail.poll()] == list(range(1, 13))
    write(path, [13], mode="a")
    assert [r["version"] for r in tail.poll()] == [13]


def test_a_file_cut_in_place_and_a_bad_line_do_not_stop_the_reader(tmp_path):
    path = tmp_path / "learner.jsonl"
    write(path, range(1, 21))
    tail = Tail(path)
    tail.poll()
    with path.open("r+") as fh:
        fh.truncate(0)
    write(path, [1], mode="a")
    with path.open("a") as fh:
        fh.write("not json\n")
    write(path, [2], mode="a")
    assert [r["version"] for r in tail.poll()] == [1, 2]
