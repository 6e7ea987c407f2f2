"""Weights published by the learner arrive bit-identical in rollout engines, version-tagged."""

from __future__ import annotations

import torch

from rollout_svc.engines.hf import HFEngine
from sluice.config.model import ModelConfig, TinyModelInit
from sluice.config.weight_sync import WeightSyncConfig
from sluice.modeling import load_policy, materialize_model_dir
from sluice.net import free_port
from weight_sync.broadcaster import WeightBroadcaster
from weight_sync.layout import plan_buckets
from weight_sync.receiver import WeightReceiver


def test_bucket_plan_covers_every_parameter_once():
    model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 3))
    buckets = plan_buckets(model.named_parameters(), bucket_bytes=300)
    names = [s.name for b in buckets for s in b.slots]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    for b in buckets:  # slots tile the bucket without gaps or overlap
        end = 0
        for s in b.slots:
            assert s.offset == end
            end += s.numel
        assert end == b.numel


def test_weights_after_sync_are_bit_identical(tmp_path):
    model_dir = materialize_model_dir(ModelConfig(init=TinyModelInit(seed=1)), tmp_path)
    learner_model, _ = load_policy(model_dir)
    cfg = WeightSyncConfig(master_port=free_port(), timeout_s=30, bucket_mb=0.05)
    engines = [HFEngine(model_dir, seed=i) for i in range(2)]
    receivers = [WeightReceiver(cfg, rank=i + 1, world_size=3, device=torch.device("cpu")) for i in range(2)]
    broadcaster = WeightBroadcaster(cfg, n_receivers=2, device=torch.device("cpu"))
    for r in receivers:
        r.start()
    try:
        broadcaster.start()
        for version in (1, 2):
            with torch.no_grad():  # a training step changes every parameter
                for p in learner_model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            broadcaster.publish(version, learner_model)
            expected = {k: v.detach().clone() for k, v in learner_model.named_parameters()}
            for engine, receiver in zip(engines, receivers):
                got = receiver.wait_for_weights(timeout_s=20)
                assert got is not None and got.version == version
                engine.load_weights(got.tensors, got.version)
                state = engine.state_dict()
                assert state.keys() == expected.keys()
                for name, tensor in expected.items():
                    assert torch.equal(state[name], tensor), name  # bit-identical
                assert engine.version == version
    finally:
        broadcaster.close()
        for r in receivers:
            r.stop()
            r._thread.join(timeout=10)
    assert all(r.error is None and r.refused_versions == 0 for r in receivers)
