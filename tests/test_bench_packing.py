"""benchmarks/packing.py end to end (`--quick`): the learner's own step, packed and padded, on
each length distribution; the batches with nothing to pack stay padded."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.bench_scripts import ROOT


def test_the_packing_benchmark_packs_only_the_batches_whose_lengths_vary(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "packing.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["distribution"]: r for r in json.loads((tmp_path / "packing.json").read_text())["rows"]}
    assert set(rows) == {"stopping-unlearnt", "mostly-stopping", "all-stopping", "plateau"}
    for name in ("stopping-unlearnt", "mostly-stopping"):
        rows_, width = rows[name]["packed_shape"]
        assert rows_ * width < 64 * rows[name]["padded_shape"][1]  # fewer positions than padding
    assert rows["all-stopping"]["packed_shape"] is None and rows["plateau"]["packed_shape"] is None
    assert all(r["padded_s"] > 0 and r["packed_s"] > 0 for r in rows.values())
    assert (tmp_path / "packing.png").stat().st_size > 0
