"""Held-out evaluation (`task.eval`): rollout service 0 scores the weights of every k-th
policy version on prompts never trained on, greedy (top_k=1) and sampled, between its batches.

Nothing of it reaches the buffer and it takes no admission quota: it is measurement, not
experience. Scoring goes through the run's own scorer (the same rewards, pool, deadlines and
`on_error`). Results: `<run dir>/metrics/eval.jsonl` (read by the plots), Prometheus
`sluice_eval_reward{mode}`, and TensorBoard scalars `eval/<mode>_reward` under `<run dir>/tb/eval`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from prometheus_client import CollectorRegistry, Gauge

from sluice.config.errors import ConfigError
from sluice.config.run import RunConfig
from sluice.metrics import JsonlLog
from sluice.rollout_svc.engines.base import SamplingParams
from sluice.rollout_svc.episodes import GroupRequest, Sample
from sluice.rollout_svc.tasks.base import Prompt, Task
from sluice.tb_events import EventWriter

log = logging.getLogger(__name__)

# (request) -> groups of samples: the producer's own single- or multi-turn path
Rollout = Callable[[GroupRequest], list[list[Sample]]]


class Evaluator:
    def __init__(
        self,
        cfg: RunConfig,
        task: Task,
        tokenize: Callable[[Prompt], list[int]],
        sampling: SamplingParams,
        registry: CollectorRegistry,
    ) -> None:
        ec = cfg.task.eval
        self.cfg = cfg
        self.every = ec.every
        try:
            self.prompts = task.held_out(ec.prompts)
        except NotImplementedError as e:
            raise ConfigError(f"config error: task.eval.every={ec.every}: {e}") from None
        self.prompt_ids = [tokenize(p) for p in self.prompts]
        modes: dict[str, tuple[SamplingParams, int]] = {}
        if ec.greedy:
            modes["greedy"] = (replace(sampling, top_k=1, on_new_weights="finish"), 1)
        if ec.samples:
            modes["sampled"] = (replace(sampling, on_new_weights="finish"), ec.samples)
        self.modes = modes
        self.last_bucket = -1
        self.log = JsonlLog(cfg.run_dir / "metrics" / "eval.jsonl")
        self._gauge = Gauge(
            "sluice_eval_reward", "Held-out reward of the last evaluation", ["mode"], registry=registry
        )
        self._tb: EventWriter | None = None

    def due(self, version: int) -> bool:
        """True once per block of `every` versions (versions a service skips still count)."""
        return self.every > 0 and version // self.every > self.last_bucket

    def run(self, version: int, rollout: Rollout) -> dict[str, float]:
        self.last_bucket = version // self.every
        t0 = time.perf_counter()
        record: dict[str, float] = {"version": float(version), "prompts": float(len(self.prompts))}
        for mode, (params, n) in self.modes.items():
            groups = rollout(
                GroupRequest(
                    self.prompts, self.prompt_ids, n, params, None, self.cfg.rollout.truncated_reward
                )
            )
            samples = [s for g in groups for s in g]
            if not samples:  # every group skipped by on_error=skip_group
                continue
            record[f"{mode}_reward"] = float(np.mean([s.reward for s in samples]))
            record[f"{mode}_truncated"] = float(np.mean([not s.finished for s in samples]))
            self._gauge.labels(mode).set(record[f"{mode}_reward"])
        record["seconds"] = time.perf_counter() - t0
        self.log.write({"time": time.time(), **record})
        self._to_tensorboard(version, record)
        log.info(
            "eval v%d: %s", version, {k: round(v, 3) for k, v in record.items() if k.endswith("_reward")}
        )
        return record

    def _to_tensorboard(self, version: int, record: dict[str, float]) -> None:
        if not self.cfg.metrics.tensorboard:
            return
        if self._tb is None:
            self._tb = EventWriter(self.cfg.run_dir / "tb" / "eval")
        self._tb.add_scalars({f"eval/{k}": v for k, v in record.items() if k.endswith("_reward")}, version)
        self._tb.flush()

    def close(self) -> None:
        self.log.close()
        if self._tb is not None:
            self._tb.close()
