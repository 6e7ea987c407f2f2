"""CURVE encryption and authentication of the ZeroMQ sockets (buffer and control plane)."""

from __future__ import annotations

from pathlib import Path

from pydantic import model_validator

from sluice.config.base import Section


class SecurityConfig(Section):
    curve: bool = False
    """Encrypt every buffer and control-plane connection with CURVE (ZeroMQ's elliptic-curve
    security) and accept only clients whose public key is authorized. Make keys with
    `sluice keys DIR`. Prometheus endpoints and the weight-sync group are not covered."""
    keys_dir: str | None = None
    """Directory written by `sluice keys`: server.key(_secret), client.key(_secret) and
    authorized/ (public keys of the clients servers accept). Needed when curve is true."""

    @model_validator(mode="after")
    def _check_keys(self) -> SecurityConfig:
        if self.curve and self.keys_dir is None:
            raise ValueError("curve is true but keys_dir is not set (make keys with `sluice keys DIR`)")
        return self

    @property
    def keys_path(self) -> Path:
        if self.keys_dir is None:
            raise ValueError("security.keys_dir is not set")
        return Path(self.keys_dir)
