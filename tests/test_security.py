"""CURVE keys and secure contexts over real ZeroMQ: authorized clients are served, others are not."""

from __future__ import annotations

import stat
import threading
import time

import pytest
import zmq

from sluice.buffer.client import BufferClient, BufferTimeout
from sluice.buffer.server import ShardServer
from sluice.config.buffer import BufferConfig
from sluice.config.security import SecurityConfig
from sluice.control.admission import AdmissionPolicy
from sluice.control.client import ControlClient
from sluice.control.server import ControlServer
from sluice.rpc import RpcTimeout
from sluice.security import SecureContext, generate_keys, secure_context


@pytest.fixture
def keys(tmp_path):
    return generate_keys(tmp_path / "keys")


def _sec(keys) -> SecurityConfig:
    return SecurityConfig(curve=True, keys_dir=str(keys.directory))


def test_generate_keys_writes_pairs_and_authorizes_the_client(keys):
    for p in (keys.server_public, keys.server_secret, keys.client_public, keys.client_secret):
        assert p.is_file()
    for secret in (keys.server_secret, keys.client_secret):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert [p.name for p in keys.authorized.iterdir()] == ["client.key"]
    server_pub, server_sec = zmq.auth.load_certificate(keys.server_secret)
    assert len(server_pub) == 40 and server_sec is not None
    with pytest.raises(FileExistsError, match="--overwrite"):
        generate_keys(keys.directory)
    again = generate_keys(keys.directory, overwrite=True)
    assert zmq.auth.load_certificate(again.server_public)[0] != server_pub


def test_without_curve_the_classes_keep_their_plain_contexts():
    assert secure_context(SecurityConfig(), "server") is None
    assert secure_context(SecurityConfig(), "client") is None


def test_missing_key_files_are_named(tmp_path):
    sec = SecurityConfig(curve=True, keys_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="server.key_secret is missing"):
        secure_context(sec, "server")
    with pytest.raises(FileNotFoundError, match="server.key is missing"):
        secure_context(sec, "client")


class SecureShard:
    """A shard served in a thread, its socket made by a CURVE server context."""

    def __init__(self, cfg: BufferConfig, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.server = ShardServer(cfg, 0, ctx=ctx)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        assert not self.thread.is_alive(), "shard thread did not stop"
        self.ctx.term()


def test_buffer_serves_authorized_clients_only(keys, tmp_path):
    server_ctx = secure_context(_sec(keys), "server")
    assert isinstance(server_ctx, SecureContext) and server_ctx.authenticator is not None
    shard = SecureShard(BufferConfig(endpoints=["tcp://127.0.0.1:*"]), server_ctx)
    endpoints = [shard.server.endpoint]
    stranger_keys = generate_keys(tmp_path / "stranger")
    # a stranger knows the server's public key but its own key is not authorized
    stranger_keys.server_public.write_bytes(keys.server_public.read_bytes())
    clients = {
        "authorized": BufferClient(endpoints, timeout_s=5, ctx=secure_context(_sec(keys), "client")),
        "plain": BufferClient(endpoints, timeout_s=1.5),
        "stranger": BufferClient(endpoints, timeout_s=1.5, ctx=secure_context(_sec(stranger_keys), "client")),
    }
    try:
        assert clients["authorized"].stats()[0].stats["queued"] == 0
        for name in ("plain", "stranger"):
            # the second request is sent after the refused handshake dropped the connection:
            # it must time out too, not block in send
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(BufferTimeout):
                    clients[name].stats()
                assert time.monotonic() - t0 < 10
        assert clients["authorized"].ping(timeout_s=5)  # refused peers did not disturb the shard
    finally:
        for c in clients.values():
            c.close()
        shard.close()


def test_control_plane_serves_authorized_clients_only(keys):
    server_ctx = secure_context(_sec(keys), "server")
    server = ControlServer(
        "tcp://127.0.0.1:*", AdmissionPolicy(batch_size=8, max_staleness=0), ctx=server_ctx
    )
    server.start()
    good = ControlClient(server.endpoint, timeout_s=5, ctx=secure_context(_sec(keys), "client"))
    plain = ControlClient(server.endpoint, timeout_s=1.5)
    try:
        assert good.admit("rollout-0", 8, 4).granted == 8
        # the second ADMIT goes after the refused handshake dropped the connection: it must
        # time out too, not block in send
        for _ in range(2):
            with pytest.raises(RpcTimeout):
                plain.admit("rollout-1", 8, 4)
        assert good.status().admission["started"] == 8  # the refused peer admitted nothing
    finally:
        good.close()
        plain.close()
        server.close()
        server_ctx.term()
