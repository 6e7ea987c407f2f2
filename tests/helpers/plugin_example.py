"""examples/sluice-plugin-example, as the end-to-end tests give it to a run: by file reference
(outside any installed package) or by the names its entry points register."""

from __future__ import annotations

from helpers.runs import ROOT

EXAMPLE = ROOT / "examples" / "sluice-plugin-example"
SOURCE = EXAMPLE / "src" / "sluice_plugin_example"
TASK_BY_FILE = f"task.name={SOURCE / 'task.py'}:FirstDigitTask"
REWARDS_BY_NAME = "task.rewards=[{fn: first_digit_right, weight: 0.7}, {fn: stops_after_one, weight: 0.3}]"


def rewards_by_file() -> str:
    f = SOURCE / "rewards.py"
    first, stops = f"'{f}:first_digit_right'", f"'{f}:stops_after_one'"
    return f"task.rewards=[{{fn: {first}, weight: 0.7}}, {{fn: {stops}, weight: 0.3}}]"
