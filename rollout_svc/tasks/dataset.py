"""Single-turn prompts from a dataset on local disk.

Formats (`format: auto` picks by the path): a JSON Lines file (`.jsonl`), a Parquet file
(`.parquet`, read with pyarrow), or a Hugging Face `datasets` dataset: a directory written by
`Dataset.save_to_disk`, or any local path `datasets.load_dataset` reads (offline: nothing is
downloaded). Each row gives the prompt (`prompt_field`) and the reference answer
(`answer_field`); its other columns go to reward functions as keyword arguments.

A prompt is text (formatted into `template`) or a chat: a list of `{role, content}` messages,
which the rollout service renders with the tokenizer's chat template (`chat: on` makes a text
prompt the user message of a chat; `system_prompt` opens every chat that has no system
message).

The task's own score is the `math` reward (the final answer equals the reference by value;
math_check.py); `task.rewards` replaces it with any reward functions (scoring.py).

Each service walks the rows in its own seeded order (a fresh shuffle each epoch), so services
do not all work on the same prompts at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from sluice.config.base import Section
from sluice.rollout_svc.tasks.base import Prompt, Score, Task
from sluice.rollout_svc.tasks.rewards import math


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
    """Prompt text of a text prompt; `{prompt}` is replaced by the row's question."""
    chat: Literal["auto", "on", "off"] = "auto"
    """auto: a prompt that is a list of messages is a chat, a text prompt is plain text; on: a
    text prompt is also sent as a chat (one user message); off: plain text only (a list of
    messages is an error)."""
    system_prompt: str | None = None
    """System message put first in every chat that has none."""
    shuffle: bool = True
    """Walk the rows in a seeded random order (per service, per epoch)."""
    max_rows: int | None = Field(default=None, ge=1)
    """Use only the first max_rows rows."""
    eval_path: str | None = None
    """Held-out rows for `task.eval` (same format rules and columns as `path`)."""


def read_rows(cfg: DatasetConfig, key: str = "path") -> list[dict[str, Any]]:
    """The rows of `task.params.<key>` (path, or eval_path), checked for the columns used."""
    where = cfg.path if key == "path" else cfg.eval_path
    assert where is not None
    path = Path(where)
    if not path.exists():
        raise FileNotFoundError(f"task.params.{key}={where!r} does not exist")
    fmt = cfg.format
    if fmt == "auto":
        fmt = "hf" if path.is_dir() else {".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix, "")
        if not fmt:
            raise ValueError(f"task.params.{key}={where!r}: cannot tell its format; set task.params.format")
    if fmt == "jsonl":
        rows = []
        with path.open() as fh:
            for i, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where}:{i}: not JSON ({e.msg})") from None
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = _read_hf(path, cfg.split)
    rows = rows[: cfg.max_rows] if cfg.max_rows else rows
    for i, row in enumerate(rows):
        for name, column in (("prompt_field", cfg.prompt_field), ("answer_field", cfg.answer_field)):
            if column not in row:
                raise ValueError(
                    f"task.params.{name}={column!r}: row {i} of {where} has no such column "
                    f"(columns: {sorted(row)})"
                )
    if not rows:
        raise ValueError(f"task.params.{key}={where!r}: no rows")
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


class DatasetTask(Task[DatasetConfig]):
    name = "dataset"
    Config = DatasetConfig

    def __init__(self, config: DatasetConfig, seed: int) -> None:
        super().__init__(config, seed)
        self.rows = read_rows(config)
        self._order: list[int] = []
        self._count = 0
        for i, row in enumerate(self.rows):  # every prompt well formed, or an error now
            self.prompt_of(i, row)

    def _next_row(self) -> int:
        if not self._order:
            self._order = list(range(len(self.rows)))
            if self.config.shuffle:
                self.rng.shuffle(self._order)
            self._order.reverse()  # pop() from the end walks the order front to back
        return self._order.pop()

    def prompt_of(self, index: int, row: dict[str, Any]) -> Prompt:
        cfg = self.config
        question = row[cfg.prompt_field]
        extra = {k: v for k, v in row.items() if k not in (cfg.prompt_field, cfg.answer_field)}
        pid = f"d{index}.{self._count}"
        if isinstance(question, list):
            if cfg.chat == "off":
                raise ValueError(f"task.params.chat=off: row {index}'s {cfg.prompt_field!r} is a chat")
            messages = _messages(question, index, cfg.prompt_field)
        elif cfg.chat == "on":
            messages = [{"role": "user", "content": cfg.template.format(prompt=question)}]
        else:
            return Prompt(pid, cfg.template.format(prompt=question), row[cfg.answer_field], row=extra)
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        return Prompt(pid, messages[-1]["content"], row[cfg.answer_field], messages=messages, row=extra)

    def sample(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            i = self._next_row()
            self._count += 1
            out.append(self.prompt_of(i, self.rows[i]))
        return out

    def held_out(self, n: int) -> list[Prompt]:
        """The first `n` rows of `eval_path`."""
        if self.config.eval_path is None:
            raise NotImplementedError("task 'dataset' evaluates on task.params.eval_path, which is not set")
        rows = read_rows(self.config, "eval_path")[:n]
        return [replace(self.prompt_of(i, row), prompt_id=f"eval{i}") for i, row in enumerate(rows)]

    def score(self, prompt: Prompt, completion: str, finished: bool) -> Score:
        result = math(prompt.text, completion, prompt.reference)
        return Score(result["reward"], {k: v for k, v in result.items() if k != "reward"})

    def vocabulary(self) -> set[str]:
        words: set[str] = set()
        for i, row in enumerate(self.rows):
            p = self.prompt_of(i, row)
            texts = [m["content"] for m in p.messages] if p.messages else [p.text]
            words |= {w for t in texts for w in t.split()} | set(str(row[self.config.answer_field]).split())
        return words


def _messages(value: list[Any], index: int, field: str) -> list[dict[str, str]]:
    """A row's chat, checked: a non-empty list of {role, content} with text contents."""
    ok = bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise ValueError(
            f"task.params.prompt_field={field!r}: row {index} is a list but not of {{role, content}} messages"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]
