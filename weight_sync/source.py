"""Where published weights come from: the learner's parameters, whole or sharded.

A `ParamSource` declares every tensor's full shape (`specs`, the same list in the same order
on every learner rank) and materializes the tensors of one bucket at a time (`gather`). With
sharded weights (FSDP2 DTensors, DeepSpeed ZeRO-3) gathering is a collective among the
learner ranks: every rank calls `gather` with the same names in the same order, and the full
tensors exist only while that bucket is packed, never the whole model at once.

    ModuleSource   plain modules (single process, DDP replicas) and FSDP2 (`fully_shard`):
                   DTensor parameters are gathered with `full_tensor()`
    ZeRO3Source    DeepSpeed ZeRO-3: `deepspeed.zero.GatheredParameters` per bucket
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from sluice.weight_sync.layout import TensorSpec


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / DeepSpeed wrappers (their parameter names carry no prefix)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


class ParamSource(ABC):
    @abstractmethod
    def specs(self) -> list[TensorSpec]:
        """Every published tensor: name, full shape, dtype; identical on every learner rank."""

    @abstractmethod
    @contextmanager
    def gather(self, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        """The full tensors of `names`, valid inside the context (a collective when sharded:
        every learner rank enters it with the same names)."""


class ModuleSource(ParamSource):
    """Parameters are read from their modules at every call: a learner that replaces them
    (loading a checkpoint with assign=True) publishes the new ones. Which module holds each
    name is listed once: `named_parameters()` walks the module tree with generators, ~0.2 ms
    a call on the quickstart's model, twice a publish (docs/architecture.md)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = unwrap(module)
        self._slots = [
            (f"{prefix}.{attr}" if prefix else attr, owner, attr)
            for prefix, owner in self.module.named_modules()
            for attr in owner._parameters
        ]

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """`named_parameters()`, from the listed slots: a tensor shared by two names (tied
        weights) under its first name only, and an unset slot left out."""
        seen: set[int] = set()
        out = []
        for name, owner, attr in self._slots:
            p = owner._parameters.get(attr)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def specs(self) -> list[TensorSpec]:
        # A DTensor's .shape is its global shape: reading it gathers nothing.
        return [TensorSpec(n, tuple(p.shape), p.dtype) for n, p in self._named()]

    @contextmanager
    def gather(self, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        params = dict(self._named())
        with torch.no_grad():
            yield {n: _full(params[n]) for n in names}


def _full(param: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(param, "full_tensor", None)  # DTensor (FSDP2, tensor parallel)
    full = full_tensor() if callable(full_tensor) else param.detach()
    if not isinstance(full, torch.Tensor):
        raise TypeError(f"{type(param).__name__}.full_tensor() gave a {type(full).__name__}, not a tensor")
    return full


class ZeRO3Source(ParamSource):
    """DeepSpeed ZeRO stage 3: each parameter holds a shard; `ds_shape` is its full shape."""

    def __init__(self, module: torch.nn.Module) -> None:
        import deepspeed  # noqa: F401  (only learners that use ZeRO-3 need it)

        self.module = unwrap(module)
        missing = [n for n, p in self.module.named_parameters() if not hasattr(p, "ds_shape")]
        if missing:
            raise ValueError(f"ZeRO3Source: parameters without ZeRO-3 partitioning, e.g. {missing[:3]}")

    def specs(self) -> list[TensorSpec]:
        # ds_shape is set on each parameter by DeepSpeed at run time (checked in __init__); torch's
        # Parameter type does not know it
        return [
            TensorSpec(n, tuple(p.ds_shape), p.dtype)  # pyright: ignore[reportAttributeAccessIssue]
            for n, p in self.module.named_parameters()
        ]

    @contextmanager
    def gather(self, names: Sequence[str]) -> Iterator[dict[str, torch.Tensor]]:
        import deepspeed

        by_name = dict(self.module.named_parameters())
        params = [by_name[n] for n in names]
        with torch.no_grad(), deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield {n: p.data for n, p in zip(names, params)}


def source_for(model: torch.nn.Module | ParamSource) -> ParamSource:
    """A source for what the learner holds: ZeRO-3 partitioned parameters, or a module."""
    if isinstance(model, ParamSource):
        return model
    first = next(unwrap(model).parameters(), None)
    if first is not None and hasattr(first, "ds_shape"):
        return ZeRO3Source(model)
    return ModuleSource(model)
