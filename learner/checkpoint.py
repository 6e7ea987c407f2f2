"""Checkpoints of a learner group: everything needed to resume, and export to a HF directory.

Layout of `<run dir>/checkpoints[-<policy>]/step_<version>/`:
    config.json, model.safetensors, tokenizer files   Hugging Face model directory (rank 0;
                                                       gathered first under ZeRO-3)
    optimizer.pt, scheduler.pt                         ddp: torch.save of the state dicts
    deepspeed/                                         deepspeed: engine.save_checkpoint (per
                                                       rank optimizer partitions, scheduler)
    critic.pt                                          an LLM workflow's value model and its optimizer
    rng_rank<r>.pt                                     torch, numpy, python and shuffle RNGs of rank r
    trainer_state.json                                 version, totals, returns window, the
                                                       leases trained since the previous checkpoint
    acked.json                                         written once those leases are ACKed: the
                                                       skip set then, and the steps still pending
                                                       (leased on a shard that was down)
A checkpoint is written into a temporary directory and renamed (complete or absent); `latest`
links to the newest. `keep_checkpoints` newest are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sluice.learner.dist import DistContext

HF_FILES_EXCLUDED = {"optimizer.pt", "scheduler.pt", "trainer_state.json", "acked.json", "deepspeed"}


def save_checkpoint(
    root: Path, version: int, trainer, dist: DistContext, state: dict[str, Any] | None, keep: int
) -> Path:
    """Collective: every rank of the group calls it. `state` is rank 0's trainer state."""
    final = root / f"step_{version:06d}"
    tmp = root / f".step_{version:06d}.tmp"
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with trainer.backend.full_params():
        if dist.is_main:
            trainer.model.save_pretrained(tmp)
            if trainer.tokenizer is not None:
                trainer.tokenizer.save_pretrained(tmp)
    trainer.backend.save(tmp)
    trainer.objective.save(tmp)
    torch.save(rng_state(trainer.generator), tmp / f"rng_rank{dist.rank}.pt")
    if dist.is_main:
        (tmp / "trainer_state.json").write_text(json.dumps({"version": version, **(state or {})}))
    dist.barrier()
    if dist.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _link_latest(root, final)
        _prune(root, keep)
    dist.barrier()
    return final


def mark_acked(checkpoint: Path, ledger: dict[str, Any]) -> None:
    """The leases listed in the checkpoint are settled, as far as their shards were up:
    `ledger` is the ledger's state after the ACKs (`LeaseLedger.state_dict`: the steps still
    pending, their shard down, and the skip set: ids whose lease was gone at the ACK, never to
    be trained again)."""
    tmp = checkpoint / ".acked.json.tmp"
    tmp.write_text(json.dumps(ledger))
    os.replace(tmp, checkpoint / "acked.json")


def resolve_resume(resume: str | None, root: Path) -> Path | None:
    """None, 'auto' (latest under root, if any) or an explicit step directory."""
    if resume is None:
        return None
    if resume == "auto":
        latest = root / "latest"
        return latest.resolve() if latest.exists() else None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"learner.resume={resume!r}: no trainer_state.json there (not a checkpoint)")
    return path.resolve()


def read_state(checkpoint: Path) -> dict[str, Any]:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    acked = checkpoint / "acked.json"
    state["acked"] = json.loads(acked.read_text()) if acked.is_file() else None
    return state


# -- RNG ---------------------------------------------------------------------------------------


def rng_state(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Every random stream a rank draws from, as tensors (torch.load(weights_only=True) safe)."""
    np_state = np.random.get_state(legacy=True)
    if not isinstance(np_state, tuple):  # a dict: the global generator is not MT19937
        raise TypeError("numpy's global random generator is not MT19937: its state cannot be saved")
    _, np_keys, np_pos, np_gauss, np_cached = np_state
    py_version, py_state, _ = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": torch.tensor([np_pos, np_gauss], dtype=torch.int64),
        "numpy_cached": torch.tensor([np_cached], dtype=torch.float64),
        "python": torch.tensor([py_version, *py_state], dtype=torch.int64),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng(checkpoint: Path, rank: int, generator: torch.Generator) -> None:
    path = checkpoint / f"rng_rank{rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the checkpoint was written by a group without rank {rank}")
    s = torch.load(path, weights_only=True)
    torch.set_rng_state(s["torch"])
    generator.set_state(s["generator"])
    pos, gauss = s["numpy_pos"].tolist()
    np.random.set_state(
        ("MT19937", s["numpy_keys"].numpy().astype(np.uint32), pos, gauss, float(s["numpy_cached"][0]))
    )
    py = s["python"].tolist()
    random.setstate((py[0], tuple(py[1:]), None))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


# -- export ------------------------------------------------------------------------------------


def _link_latest(root: Path, final: Path) -> None:
    tmp_link = root / ".latest.tmp"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(final.name)
    os.replace(tmp_link, root / "latest")


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
