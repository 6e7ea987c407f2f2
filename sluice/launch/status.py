"""`sluice status`: one table of every role of a running run, from what the roles serve.

Sources, all read-only:
- the control server (learner rank 0, `STATUS`): learner stats, each rollout's last heartbeat,
  admission counters;
- every buffer shard (`STATS`): queued, leased, capacity, queued versions;
- `<run dir>/endpoints/<role>.json` when the run directory is readable here: pid and
  Prometheus port of each role.

A source that does not answer within the timeout shows as `unreachable`; the others still show.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import JustifyMethod
from rich.table import Table

from sluice.buffer.client import BufferClient
from sluice.config.rollout import rollout_service_id
from sluice.config.run import RunConfig
from sluice.control.client import ControlClient
from sluice.control.messages import ServiceStatus
from sluice.rpc import RpcError, RpcTimeout
from sluice.security import secure_context


@dataclass
class RoleRow:
    role: str
    state: str  # ok | stale (no heartbeat for 3 periods) | unreachable
    version: float | None = None  # policy version the role holds (buffer: newest queued)
    samples_per_s: float | None = None  # learner: trained; rollout: generated per generating second
    staleness: float | None = None  # learner: mean version lag of the last batch
    fill: float | None = None  # buffer: (queued + leased) / capacity
    queued: int | None = None  # buffer: trajectories waiting
    lag: float | None = None  # versions behind the learner (rollout: its weights; buffer: oldest queued)
    heartbeat_age_s: float | None = None  # rollout: seconds since its last heartbeat
    pid: int | None = None  # from <run dir>/endpoints (same host only)
    metrics_port: int | None = None  # Prometheus port, from <run dir>/endpoints


@dataclass
class Snapshot:
    time: float
    rows: list[RoleRow] = field(default_factory=list)
    admission: dict[str, float] = field(default_factory=dict)
    learner: dict[str, float] = field(default_factory=dict)

    @property
    def learner_reachable(self) -> bool:
        return bool(self.learner)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def collect(cfg: RunConfig, timeout_s: float = 2.0) -> Snapshot:
    snap = Snapshot(time=time.time())
    ctx = secure_context(cfg.security, "client")
    try:
        learner_row, rollout_rows = _control_rows(cfg, snap, ctx, timeout_s)
        buffer_rows = [_shard_row(cfg, k, snap, ctx, timeout_s) for k in range(cfg.buffer.shards)]
    finally:
        if ctx is not None:
            ctx.term()
    snap.rows = [learner_row, *buffer_rows, *rollout_rows]
    _add_endpoints(cfg, snap.rows)
    return snap


def _control_rows(cfg: RunConfig, snap: Snapshot, ctx, timeout_s: float) -> tuple[RoleRow, list[RoleRow]]:
    client = ControlClient(cfg.control.endpoint, timeout_s=timeout_s, ctx=ctx)
    try:
        status = client.status()
    except (RpcTimeout, RpcError):
        expected = [RoleRow(rollout_service_id(i), "unreachable") for i in range(cfg.rollout.services)]
        return RoleRow("learner", "unreachable"), expected
    finally:
        client.close()
    snap.learner = dict(status.learner)
    snap.admission = dict(status.admission)
    lv = status.learner.get("version", 0.0)
    learner = RoleRow(
        "learner",
        "ok",
        version=lv,
        samples_per_s=status.learner.get("samples_per_s"),
        staleness=status.learner.get("staleness_mean"),
    )
    # A service heartbeats as `<role>.<incarnation>`: show each role once, by its newest life.
    newest: dict[str, ServiceStatus] = {}
    for sid, s in status.services.items():
        role = sid.split(".", 1)[0]
        if role not in newest or s.age_s < newest[role].age_s:
            newest[role] = s
    rows = []
    for sid in sorted(newest, key=_role_key):
        s = newest[sid]
        version = s.stats.get("version")
        gen_s = s.stats.get("generate_s", 0.0)
        rows.append(
            RoleRow(
                sid,
                "ok" if s.age_s < 3 * cfg.control.heartbeat_s else "stale",
                version=version,
                samples_per_s=s.stats.get("samples", 0.0) / gen_s if gen_s > 0 else None,
                lag=lv - version if version is not None else None,
                heartbeat_age_s=s.age_s,
            )
        )
    return learner, rows


def _shard_row(cfg: RunConfig, shard: int, snap: Snapshot, ctx, timeout_s: float) -> RoleRow:
    client = BufferClient([cfg.buffer.endpoint(shard)], timeout_s=timeout_s, ctx=ctx)
    try:
        reply = client.stats()[0]
    except (RpcTimeout, RpcError):
        return RoleRow(f"buffer-{shard}", "unreachable")
    finally:
        client.close()
    if reply is None:  # (stats() gives None only when told missing_ok)
        return RoleRow(f"buffer-{shard}", "unreachable")
    st = reply.stats
    versions = [int(v) for v, n in reply.versions.items() if n > 0]
    lv = snap.learner.get("version")
    capacity = st.get("capacity") or cfg.buffer.capacity
    return RoleRow(
        f"buffer-{shard}",
        "ok",
        version=float(max(versions)) if versions else None,
        fill=(st.get("queued", 0) + st.get("leased", 0)) / capacity,
        queued=st.get("queued"),
        lag=lv - min(versions) if versions and lv is not None else None,
    )


def _add_endpoints(cfg: RunConfig, rows: list[RoleRow]) -> None:
    if cfg.run.dir is None:
        return
    d = Path(cfg.run.dir) / "endpoints"
    for row in rows:
        p = d / f"{row.role}.json"
        if p.is_file():
            rec = json.loads(p.read_text())
            row.pid, row.metrics_port = rec.get("pid"), rec.get("metrics_port")


def _role_key(role: str) -> tuple[str, int]:
    name, _, index = role.rpartition("-")
    return (name, int(index)) if index.isdigit() else (role, -1)


# -- rendering -----------------------------------------------------------------------------------

STATE_STYLE = {"ok": "green", "stale": "yellow", "unreachable": "red"}


def render(snap: Snapshot, title: str = "") -> Table:
    adm = snap.admission
    caption = (
        f"admission: started {adm.get('started', 0):.0f} / quota {adm.get('quota', 0):.0f}, "
        f"refused asks {adm.get('refused_asks', 0):.0f}"
        if adm
        else "control plane unreachable"
    )
    table = Table(title=title or None, caption=caption, expand=False)
    columns: list[tuple[str, JustifyMethod]] = [
        ("role", "left"),
        ("state", "left"),
        ("version", "right"),
        ("samples/s", "right"),
        ("staleness", "right"),
        ("buffer fill", "right"),
        ("lag (versions)", "right"),
        ("heartbeat", "right"),
        ("pid", "right"),
        ("metrics", "right"),
    ]
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for r in snap.rows:
        fill = f"{100 * r.fill:.0f}% ({r.queued} queued)" if r.fill is not None else ""
        table.add_row(
            r.role,
            f"[{STATE_STYLE.get(r.state, 'white')}]{r.state}",
            _num(r.version, "{:.0f}"),
            _num(r.samples_per_s, "{:.1f}"),
            _num(r.staleness, "{:.2f}"),
            fill,
            _num(r.lag, "{:.0f}"),
            _num(r.heartbeat_age_s, "{:.1f}s ago"),
            _num(r.pid, "{}"),
            _num(r.metrics_port, ":{}"),
        )
    return table


def _num(value, fmt: str) -> str:
    return "" if value is None else fmt.format(value)
