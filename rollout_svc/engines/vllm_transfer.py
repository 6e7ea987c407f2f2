"""A vLLM weight-transfer engine that loads weights from a safetensors file (shared memory).

vLLM's weight-transfer registry (`vllm.distributed.weight_transfer`) lets a worker take new
weights through a named backend: `start_weight_update` -> `update_weights(info)`* ->
`finish_weight_update`. Its built-in backends are CUDA-only (nccl, CUDA IPC); this one works
on every device: the rollout service writes the received tensors to a safetensors file in
`/dev/shm`, and the worker maps it and loads the tensors through vLLM's layerwise reload, which
re-runs the kernel-format processing (the CPU backend repacks some weights, so a plain
`model.load_weights` would leave stale packed copies).

The file is the channel because `collective_rpc` arguments carry only small control messages
(and, with a multi-process executor, cross a process boundary). Registered as `sluice_file`
when this module is imported; `rollout_svc.engines.vllm` imports it before building the LLM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "sluice_file"


@runtime_checkable
class _LoadsWeights(Protocol):
    """What every vLLM model has and vLLM's type of the engine's model (nn.Module) does not say."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the file path travels with each update."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file holding (a chunk of) the new weights, HF names


class SafetensorsFileTransfer(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        model = self.model
        if not isinstance(model, _LoadsWeights):
            raise TypeError(f"{type(model).__name__} has no load_weights: not a vLLM model")
        with safe_open(update_info.path, framework="pt", device="cpu") as f:
            model.load_weights((name, f.get_tensor(name)) for name in f.keys())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":  # a CPU worker has no accelerator to synchronize
            torch.accelerator.synchronize()

    def shutdown(self) -> None:
        pass


class RegisteringWorkerExtension:
    """Given to vLLM as `worker_extension_cls`: a worker in another process (multi-process
    engine core, tensor parallelism) imports this module to build its class, and importing
    it registers the backend there too. Adds no methods."""


def register() -> None:
    """Make `sluice_file` a weight-transfer backend of this process (idempotent)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, SafetensorsFileTransfer)


register()
