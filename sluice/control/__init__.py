"""The control plane: small messages between rollout services and the learner (admission,
heartbeats, status). Never on the data path."""
