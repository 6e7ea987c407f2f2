"""sluice/accelerators.py: the launcher learns that torch here is CPU-only without importing it,
and says "maybe" (ask torch) for every build or plugin that could add an accelerator."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from sluice import accelerators


def test_planning_a_cpu_run_imports_no_torch():
    """What `sluice run` does before it spawns a role: resolve the engine and plan the threads."""
    child = (
        "import sys\n"
        "from sluice.config.loader import load_config\n"
        "from sluice.launch.threads import plan_threads\n"
        "from sluice.rollout_svc.engines.registry import resolve_engine\n"
        "cfg = plan_threads(load_config('configs/quickstart.yaml', ['rollout.engine=auto']), 2)\n"
        "print(resolve_engine('auto'), cfg.learner.torch_threads, 'torch' in sys.modules)\n"
    )
    import torch

    if torch.cuda.is_available() or not accelerators.cpu_only():
        pytest.skip("this torch build may see an accelerator")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["hf", "1", "False"], out.stdout + out.stderr


def test_the_build_record_is_torchs_own():
    import torch

    build = accelerators.torch_build_info()
    assert build is not None and build.__version__ == torch.__version__
    assert build.cuda == torch.version.cuda and build.hip == torch.version.hip
    assert accelerators.cpu_only() == (torch.version.cuda is None and torch.version.hip is None)
    assert accelerators.cuda_available() == torch.cuda.is_available()


@pytest.mark.parametrize("build", [{"cuda": "12.8", "hip": None}, {"cuda": None, "hip": "6.4"}, None])
def test_an_accelerator_build_or_no_record_is_a_maybe(monkeypatch, build):
    record = None if build is None else SimpleNamespace(**build)
    monkeypatch.setattr(accelerators, "torch_build_info", lambda: record)
    assert accelerators.cpu_only() is False


def test_a_device_plugin_makes_a_cpu_build_a_maybe(monkeypatch):
    monkeypatch.setattr(accelerators, "torch_build_info", lambda: SimpleNamespace(cuda=None, hip=None))
    assert accelerators.cpu_only() is True
    monkeypatch.setattr(accelerators, "PLUGINS", ("json",))  # any installed module stands in for torch_npu
    assert accelerators.cpu_only() is False


def test_an_unreadable_build_record_is_a_maybe(monkeypatch):
    def broken():
        raise SyntaxError("torch/version.py")

    monkeypatch.setattr(accelerators, "torch_build_info", broken)
    assert accelerators.cpu_only() is False
