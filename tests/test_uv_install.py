"""scripts/uv_install.sh: uv installs from exactly the sources pip is configured with. pip's
configuration is given here by PIP_* variables alone (PIP_CONFIG_FILE=/dev/null: no file is
read), so the options uv gets follow from the test, not from this machine's pip.conf."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.executable).parent.parent


def uv_sources(**pip_env: str) -> list[tuple[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, VENV=str(VENV), **pip_env)
    out = subprocess.run(
        ["bash", "-c", f"source {ROOT / 'scripts' / 'uv_install.sh'} && uv_sources"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    return list(zip(out[::2], out[1::2], strict=True))


def test_every_configured_source_becomes_a_uv_option(tmp_path):
    wheels, simple, constraints = tmp_path / "wheels", tmp_path / "simple", tmp_path / "c.txt"
    wheels.mkdir()
    simple.mkdir()
    constraints.write_text("torch<=2.14\n")
    got = uv_sources(
        PIP_FIND_LINKS=str(wheels),
        PIP_INDEX_URL="https://mirror.example/simple",
        PIP_EXTRA_INDEX_URL=f"file://{simple} https://other.example/simple",
        PIP_CONSTRAINT=str(constraints),
    )
    assert sorted(got) == sorted(
        [
            ("--find-links", str(wheels)),
            ("--index-url", "https://mirror.example/simple"),
            ("--extra-index-url", f"file://{simple}"),
            ("--extra-index-url", "https://other.example/simple"),
            ("--constraint", str(constraints)),
        ]
    )


def test_a_local_store_that_does_not_exist_is_left_out_as_pip_skips_it(tmp_path):
    there = tmp_path / "there"
    there.mkdir()
    got = uv_sources(
        PIP_FIND_LINKS=f"{tmp_path / 'gone'} {there}",
        PIP_EXTRA_INDEX_URL=f"file://{tmp_path / 'gone-index'}",
    )
    assert got == [("--find-links", str(there))]


def test_settings_that_are_not_sources_are_not_passed():
    assert uv_sources(PIP_DEFAULT_TIMEOUT="180", PIP_DISABLE_PIP_VERSION_CHECK="1") == []
