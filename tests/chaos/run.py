"""The chaos suite's whole matrix, for a report: every fault under `sluice run` and/or
`sluice ray`, one after another (2 cores: never two runs at once). Prints the summary table
and writes it as JSON.

    python tests/chaos/run.py [--launcher run|ray|both] [--steps N --at-step K] [--out chaos.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from harness import FAULTS, run_with_fault, table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--launcher", choices=["run", "ray", "both"], default="both")
    ap.add_argument("--out", type=Path, default=Path("chaos.json"))
    ap.add_argument("--steps", type=int, default=80, help="learner steps per run")
    ap.add_argument("--at-step", type=int, default=30, help="the step at which the fault strikes")
    args = ap.parse_args()
    launchers = ["run", "ray"] if args.launcher == "both" else [args.launcher]
    reports = []
    for launcher in launchers:
        for fault in FAULTS:
            with tempfile.TemporaryDirectory(prefix="sluice-chaos-") as work:
                print(f"{launcher}: {fault.name} ...", flush=True)
                reports.append(run_with_fault(launcher, fault, Path(work), args.at_step, args.steps))
                print(table(reports[-1:]), flush=True)
    print(table(reports))
    args.out.write_text(json.dumps([r.as_dict() for r in reports], indent=1))
    print(f"wrote {args.out}")
    return 0 if all(not r.failures() for r in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())
