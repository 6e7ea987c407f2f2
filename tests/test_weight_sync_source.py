"""ModuleSource (sluice/weight_sync/source.py): the names, shapes and tensors a publish reads
are `named_parameters()`'s, also after the parameters are replaced."""

from __future__ import annotations

import torch

from sluice.weight_sync.source import ModuleSource


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two names
        self.register_parameter("unset", None)


def test_specs_follow_named_parameters_with_tied_weights_once():
    model = Tied()
    source = ModuleSource(model)
    expected = [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()]
    assert [(s.name, s.shape, s.dtype) for s in source.specs()] == expected
    assert "head.weight" not in [s.name for s in source.specs()]


def test_gather_reads_parameters_replaced_after_the_source_was_made():
    model = Tied()
    source = ModuleSource(model)
    fresh = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()}
    model.load_state_dict(fresh, assign=True)  # new Parameter objects in the same modules
    names = [s.name for s in source.specs()]
    with source.gather(names) as full:
        assert all(torch.equal(full[n], torch.full_like(full[n], 7.0)) for n in names)
        assert full["block.0.weight"].data_ptr() == model.block[0].weight.data_ptr()
