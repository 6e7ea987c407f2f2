"""Whether torch on this machine could see an accelerator, answered without importing torch when
the answer is certain.

The launchers plan each role's threads before any role starts (sluice/launch/threads.py), and
that plan asks where the learner and the engine compute. Importing torch only to hear "no
accelerator" cost `sluice run` 1.3-1.9 s of its start on a 2-core machine, before the first role
was spawned (docs/architecture.md, "Cores and threads"). A CPU-only torch build with no
accelerator plugin installed cannot see one on any machine, and `torch.version` says which build
it is without importing torch; anything else is a "maybe", and then torch itself is asked.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

# Out-of-tree device plugins that add an accelerator to a CPU-looking torch build.
PLUGINS = ("torch_npu",)


def torch_build_info() -> ModuleType | None:
    """torch's own `torch/version.py`, executed alone (it imports only `typing`), or None where
    torch is not installed."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).with_name("version.py")
    version_spec = importlib.util.spec_from_file_location("_sluice_torch_version", path)
    if version_spec is None or version_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(version_spec)
    version_spec.loader.exec_module(module)
    return module


def cpu_only() -> bool:
    """True: torch here can compute on the CPU only (a build without CUDA or ROCm, and no device
    plugin installed). False: there may be an accelerator; ask torch."""
    if any(importlib.util.find_spec(name) is not None for name in PLUGINS):
        return False
    try:
        build = torch_build_info()
    except (OSError, SyntaxError, ImportError):
        return False  # an unusual install: let torch answer
    return build is not None and getattr(build, "cuda", None) is None and getattr(build, "hip", None) is None


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, without importing torch where the build is CPU-only."""
    if cpu_only():
        return False
    import torch

    return torch.cuda.is_available()
