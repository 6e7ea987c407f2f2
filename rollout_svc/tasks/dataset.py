"""Single-turn prompts from a dataset on local disk, scored by a named reward function.

Formats (`format: auto` picks by the path): a JSON Lines file (`.jsonl`), a Parquet file
(`.parquet`, read with pyarrow), or a Hugging Face `datasets` dataset: a directory written by
`Dataset.save_to_disk`, or any local path `datasets.load_dataset` reads (offline: nothing is
downloaded). Each row gives the prompt (`prompt_field`, formatted into `template`) and the
reference answer (`answer_field`).

Rewards: `math` (the final answer equals the reference by value; see `math_check.py`),
`exact` (the completion, whitespace-normalised, equals the reference).

Each service walks the rows in its own seeded order (a fresh shuffle each epoch), so services
do not all work on the same prompts at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from sluice.config.base import Section
from sluice.rollout_svc.tasks.base import Prompt, Score, Task
from sluice.rollout_svc.tasks.math_check import extract_answer, math_reward


class DatasetConfig(Section):
    path: str
    """A .jsonl file, a .parquet file, or a local Hugging Face datasets directory."""
    format: Literal["auto", "jsonl", "parquet", "hf"] = "auto"
    """How to read `path`; auto: by its suffix (a directory is hf)."""
    split: str = "train"
    """Split to use when the dataset has several (hf)."""
    prompt_field: str = "prompt"
    """Column holding the question."""
    answer_field: str = "answer"
    """Column holding the reference answer."""
    template: str = "{prompt}"
    """Prompt text; `{prompt}` is replaced by the row's question."""
    reward: Literal["math", "exact"] = "math"
    """Reward function: math (answers equal by value) or exact (string equality)."""
    shuffle: bool = True
    """Walk the rows in a seeded random order (per service, per epoch)."""
    max_rows: int | None = Field(default=None, ge=1)
    """Use only the first max_rows rows."""


def read_rows(cfg: DatasetConfig) -> list[dict[str, Any]]:
    path = Path(cfg.path)
    if not path.exists():
        raise FileNotFoundError(f"task.params.path={cfg.path!r} does not exist")
    fmt = cfg.format
    if fmt == "auto":
        fmt = "hf" if path.is_dir() else {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix, "")
        if not fmt:
            raise ValueError(f"task.params.path={cfg.path!r}: cannot tell its format; set task.params.format")
    if fmt == "jsonl":
        rows = []
        with path.open() as fh:
            for i, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{cfg.path}:{i}: not JSON ({e.msg})") from None
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = _read_hf(path, cfg.split)
    rows = rows[: cfg.max_rows] if cfg.max_rows else rows
    for i, row in enumerate(rows):
        for key in (cfg.prompt_field, cfg.answer_field):
            if key not in row:
                raise ValueError(f"{cfg.path}: row {i} has no field {key!r} (fields: {sorted(row)})")
    if not rows:
        raise ValueError(f"{cfg.path}: no rows")
    return rows


def _read_hf(path: Path, split: str) -> list[dict[str, Any]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(path))
    else:
        ds = datasets.load_dataset(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: no split {split!r} (splits: {sorted(ds)})")
        ds = ds[split]
    return ds.to_list()


class DatasetTask(Task):
    name = "dataset"
    Config = DatasetConfig
    config: DatasetConfig  # the instance of Config that __init__ is given

    def __init__(self, config: DatasetConfig, seed: int) -> None:
        super().__init__(config, seed)
        self.rows = read_rows(config)
        self._order: list[int] = []
        self._count = 0

    def _next_row(self) -> int:
        if not self._order:
            self._order = list(range(len(self.rows)))
            if self.config.shuffle:
                self.rng.shuffle(self._order)
            self._order.reverse()  # pop() from the end walks the order front to back
        return self._order.pop()

    def prompt_text(self, row: dict[str, Any]) -> str:
        return self.config.template.format(prompt=row[self.config.prompt_field])

    def sample(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            i = self._next_row()
            row = self.rows[i]
            self._count += 1
            out.append(Prompt(f"d{i}.{self._count}", self.prompt_text(row), row[self.config.answer_field]))
        return out

    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        if self.config.reward == "exact":
            correct = " ".join(completion.split()) == " ".join(str(prompt.reference).split())
            return Score(float(correct), {"correct": float(correct)})
        reward = math_reward(completion, prompt.reference)
        return Score(reward, {"correct": reward, "answered": float(extract_answer(completion) is not None)})

    def vocabulary(self) -> set[str]:
        words: set[str] = set()
        for row in self.rows:
            words |= set(self.prompt_text(row).split()) | set(str(row[self.config.answer_field]).split())
        return words
