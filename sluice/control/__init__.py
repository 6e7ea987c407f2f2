"""The control plane: small messages between rollout services and the learner (admission,
heartbeats, status, weight-sync membership). Never on the data path."""
