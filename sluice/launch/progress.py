"""The training progress bar both launchers show (rich): version / total steps and a live line."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def training_progress(console: Console, *, enabled: bool, refresh_per_second: float) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("v{task.completed:.0f}/{task.total:.0f}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
        refresh_per_second=refresh_per_second,
    )
