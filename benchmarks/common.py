"""What the learning benchmarks share: the `sluice run` command line, and (workflows.py,
multi_agent.py) their runs one after
another (2 cores: never two at once) under a progress bar, in one temporary folder, and the
JSON and PNG each writes."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

Run = Callable[[Path], dict]  # given the work folder, runs one configuration; its results


def sluice_run_cmd(config: Path | str, *overrides: str) -> list[str]:
    """The command line of `sluice run CONFIG OVERRIDES... --no-progress` in this interpreter."""
    return [sys.executable, "-m", "sluice.cli", "run", str(config), *overrides, "--no-progress"]


def run_in_turn(console: Console, runs: list[tuple[str, Run]]) -> list[dict]:
    """Each (label, run) in order, with a progress bar naming the one running."""
    out = []
    with tempfile.TemporaryDirectory() as work, Progress(console=console) as progress:
        bar = progress.add_task("runs", total=len(runs))
        for label, run in runs:
            progress.update(bar, description=label)
            out.append(run(Path(work)))
            progress.advance(bar)
    return out


def write_report(console: Console, out: Path, name: str, payload: dict, plot: Callable[[Path], None]) -> None:
    """<out>/<name>.json (the payload) and <out>/<name>.png (drawn by `plot`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    plot(out / f"{name}.png")
    console.print(f"wrote {out / f'{name}.json'} and {name}.png")


@contextmanager
def figure(path: Path, ncols: int = 1, size: tuple[float, float] = (8, 5)) -> Iterator[list]:
    """Axes to draw on (one per column); the figure is saved to `path` as a PNG on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False)
    try:
        yield list(axes[0])
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def write_config(work: Path, tree: dict) -> tuple[Any, Path]:
    """The run config `tree` (its run directory made), validated and written to
    <work>/config.yaml, for the role processes a benchmark starts; (config, its path)."""
    from sluice.config.loader import config_from_dict, dump_config

    cfg = config_from_dict(tree)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    path = work / "config.yaml"
    dump_config(cfg, path)
    return cfg, path
