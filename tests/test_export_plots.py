"""`sluice export` (checkpoint -> Hugging Face dir) and the run-end PNG plots."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sluice.config.loader import load_config
from sluice.export import ExportError, export_checkpoint, resolve_checkpoint
from sluice.learner.checkpoint import save_checkpoint
from sluice.learner.dist import DistContext
from sluice.learner.trainer import Trainer
from sluice.modeling import load_policy
from sluice.modeling.policy import materialize_policy_dir
from sluice.plots import write_run_plots

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def run_with_checkpoint(tmp_path):
    """A run directory with a real learner checkpoint (model, optimizer, trainer state)."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run.dir={run_dir}"])
    trainer = Trainer(cfg, DistContext(), materialize_policy_dir(cfg))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)  # trained weights differ from the initial ones
    save_checkpoint(run_dir / "checkpoints", 7, trainer, DistContext(), {"totals": {"samples": 1}}, keep=1)
    return run_dir, trainer.model


def test_export_writes_model_and_tokenizer_only(run_with_checkpoint, tmp_path):
    run_dir, model = run_with_checkpoint
    assert resolve_checkpoint(run_dir) == (run_dir / "checkpoints" / "step_000007").resolve()
    out = export_checkpoint(run_dir, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "trainer_state.json", "rng_rank0.pt"}
    exported, tokenizer = load_policy(out)
    for (name, a), (_, b) in zip(model.named_parameters(), exported.named_parameters()):
        assert torch.equal(a, b), name
    assert tokenizer.encode("3 1 4 =", add_special_tokens=False)


def test_export_casts_and_refuses_to_clobber(run_with_checkpoint, tmp_path):
    run_dir, _ = run_with_checkpoint
    out = export_checkpoint(run_dir / "checkpoints", tmp_path / "hf", dtype="bfloat16")
    assert next(load_policy(out, "bfloat16")[0].parameters()).dtype == torch.bfloat16
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(run_dir, out)
    export_checkpoint(run_dir, out, overwrite=True)
    with pytest.raises(ExportError, match="is not a checkpoint"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "x")
    with pytest.raises(ExportError, match="dtype 'int8'"):
        export_checkpoint(run_dir, tmp_path / "y", dtype="int8")


def test_export_command(run_with_checkpoint, tmp_path):
    run_dir, _ = run_with_checkpoint
    cmd = [sys.executable, "-m", "sluice.cli", "export"]
    ok = subprocess.run([*cmd, str(run_dir), str(tmp_path / "hf")], capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and "exported to" in ok.stdout, ok.stderr
    bad = subprocess.run([*cmd, str(tmp_path), str(tmp_path / "z")], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plots_from_metrics(tmp_path):
    t0 = time.time()
    _write_jsonl(
        tmp_path / "metrics" / "learner.jsonl",
        [
            {
                "time": t0 + 0.5 * v,
                "version": v,
                "reward_mean": v / 40,
                "staleness_mean": 1.0,
                "staleness_max": 2,
                "samples": 128,
                "wait_frac": 0.2,
                "total_dropped_stale": v,
            }
            for v in range(1, 41)
        ],
    )
    _write_jsonl(
        tmp_path / "metrics" / "rollout-0.jsonl",
        [{"time": t0 + 0.3 * b, "version": b // 2, "samples": 64, "reward_mean": 0.1} for b in range(60)],
    )
    written = write_run_plots(tmp_path)
    assert [p.name for p in written] == ["reward.png", "staleness.png", "throughput.png"]
    for p in written:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 10_000


def test_plots_without_metrics_write_nothing(tmp_path):
    assert write_run_plots(tmp_path) == []
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "plots", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 1 and "no metrics" in proc.stderr
