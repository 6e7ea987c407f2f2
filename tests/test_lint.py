"""The code base stays lint-clean: ruff check, ruff format and pyright (basic mode), each
configured in pyproject.toml; .pre-commit-config.yaml runs the same three before a commit."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Installed by scripts/setup.sh unless it is told not to (SLUICE_NO_VLLM=1): without it, pyright
# cannot resolve these imports, and that is the only thing it may report about them.
OPTIONAL_IMPORTS = ("vllm",)


def test_ruff_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_ruff_format_is_clean():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"run `ruff format` on these:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def _missing_optional(diagnostic: dict) -> bool:
    """An unresolved import of an optional dependency this interpreter does not have."""
    if diagnostic.get("rule") != "reportMissingImports":
        return False
    return any(
        f'"{name}' in diagnostic["message"] and importlib.util.find_spec(name) is None
        for name in OPTIONAL_IMPORTS
    )


@pytest.mark.timeout(400)  # ~30-50 s alone; more on a loaded machine
@pytest.mark.skipif(
    importlib.util.find_spec("pyright") is None,
    reason="pyright is not installed (it is in the dev extra: pip install -e .[dev])",
)
def test_pyright_reports_no_errors():
    # --outputjson also keeps the pyright wrapper from asking PyPI for a newer version; the
    # interpreter is this one, for a venv that is not ./.venv (pyproject's [tool.pyright]).
    proc = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"},
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"pyright did not run (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    errors = [
        d for d in report["generalDiagnostics"] if d["severity"] == "error" and not _missing_optional(d)
    ]
    lines = [
        f"{Path(d['file']).relative_to(ROOT)}:{d['range']['start']['line'] + 1}: "
        f"{d['message']} ({d.get('rule', '')})"
        for d in errors
    ]
    if errors:
        pytest.fail(f"pyright: {len(errors)} errors\n" + "\n".join(lines), pytrace=False)
