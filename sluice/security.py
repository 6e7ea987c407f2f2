"""CURVE security for the ZeroMQ sockets of the buffer and the control plane.

Every buffer and control-plane socket is made by the `zmq.Context` its server or client class is
given. With `security.curve` the roles hand those classes a context from `secure_context`: its
default socket options turn every socket it creates into a CURVE server (shards, the control
server) or a CURVE client that knows the servers' public key (buffer and control clients,
`sluice status`). A server context also runs a ZAP authenticator (pyzmq's
`ThreadAuthenticator`) that accepts only the public keys in `<keys_dir>/authorized/`: a peer
without an authorized key pair never gets a connection, so its requests time out. Traffic is
encrypted and both ends are authenticated. Without `security.curve`, `secure_context` returns
None and the classes make their usual plain contexts.

Keys (`sluice keys DIR`, made by pyzmq's `zmq.auth.create_certificates`, Z85 text files):

    server.key, server.key_secret   the servers' key pair (every shard, the control server)
    client.key, client.key_secret   the clients' key pair (rollouts, learner, `sluice status`)
    authorized/client.key           public keys servers accept (copy more here to admit more)

Not covered: the Prometheus HTTP endpoints and the weight-sync store and collective group
(torch.distributed has no encryption); keep those on a private network.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from sluice.config.security import SecurityConfig

SERVER, CLIENT = "server", "client"
AUTHORIZED = "authorized"


@dataclass(frozen=True)
class KeyFiles:
    """Where `generate_keys` put a key set."""

    directory: Path

    server_public = property(lambda self: self.directory / f"{SERVER}.key")
    server_secret = property(lambda self: self.directory / f"{SERVER}.key_secret")
    client_public = property(lambda self: self.directory / f"{CLIENT}.key")
    client_secret = property(lambda self: self.directory / f"{CLIENT}.key_secret")
    authorized = property(lambda self: self.directory / AUTHORIZED)


def generate_keys(directory: str | Path, overwrite: bool = False) -> KeyFiles:
    """Make a server and a client key pair in `directory` and authorize the client's public
    key. Secret files are readable by their owner only. Refuses to replace existing keys
    unless `overwrite`, because every running role would lose its connections."""
    keys = KeyFiles(Path(directory))
    if keys.server_secret.exists() and not overwrite:
        raise FileExistsError(f"{keys.server_secret} exists (pass --overwrite to replace the keys)")
    keys.directory.mkdir(parents=True, exist_ok=True)
    for name in (SERVER, CLIENT):
        zmq.auth.create_certificates(keys.directory, name)
    for secret in (keys.server_secret, keys.client_secret):
        os.chmod(secret, 0o600)
    shutil.rmtree(keys.authorized, ignore_errors=True)
    keys.authorized.mkdir()
    shutil.copy(keys.client_public, keys.authorized / keys.client_public.name)
    return keys


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"security.keys_dir: {path} is missing (make keys with `sluice keys DIR`)")
    public, secret_key = zmq.auth.load_certificate(path)
    if secret and secret_key is None:
        raise ValueError(f"security.keys_dir: {path} holds no secret key")
    return public, secret_key


class SecureContext(zmq.Context):
    """A context whose sockets use CURVE; a server context owns its ZAP authenticator."""

    authenticator: ThreadAuthenticator | None = None

    def term(self) -> None:
        self._stop_authenticator()
        super().term()

    def destroy(self, linger: int | None = None) -> None:
        self._stop_authenticator()
        super().destroy(linger)

    def _stop_authenticator(self) -> None:
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


def secure_context(security: SecurityConfig, side: Literal["server", "client"]) -> zmq.Context | None:
    """A new context whose sockets are CURVE servers or clients, or None without
    `security.curve` (the caller then makes its usual plain context)."""
    if not security.curve:
        return None
    keys = KeyFiles(security.keys_path)
    if side == SERVER:
        public, secret = _load(keys.server_secret, True)
        if not keys.authorized.is_dir():
            raise FileNotFoundError(f"security.keys_dir: {keys.authorized} is missing")
        ctx = SecureContext()
        # The authenticator's own inproc sockets are made before the CURVE defaults are set.
        ctx.authenticator = ThreadAuthenticator(ctx)
        ctx.authenticator.start()
        ctx.authenticator.configure_curve(domain="*", location=str(keys.authorized))
        ctx.setsockopt(zmq.CURVE_SERVER, 1)
    else:
        server_public, _ = _load(keys.server_public, False)
        public, secret = _load(keys.client_secret, True)
        ctx = SecureContext()
        ctx.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, public)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return ctx
