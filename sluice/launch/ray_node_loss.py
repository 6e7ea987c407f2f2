"""Which roles a lost node took with it, so the Ray driver handles them as one event.

A node that dies takes every role Ray placed on it, but the driver learns of their deaths one
by one: the role whose connection broke first is reported at once, the others up to the
cluster's node-death detection later (seconds to tens of seconds). Handled one by one, a
learner that happened to be reported before its node's shard would restart at the shard's old
address and then again once the shard moved. So when a role's process dies, the roles that
shared its node are asked whether they are still there (a call to their actor, answered in
milliseconds by a live one); those that do not answer are waited for, and everything that
ended is handled shards first, then learners, then rollout services
(docs/architecture.md, "Ray launcher").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

PING_S = 5.0  # how long a role on a dead role's node has to answer before it counts as lost
NODE_LOSS_WAIT_S = 60.0  # how long the deaths of a lost node's other roles may take to be reported

HANDLING_RANK = {"buffer": 0, "learner": 1}  # then rollout services (2)


def handling_rank(kind: str) -> int:
    """Where a role of `kind` goes among those that ended together: a shard's move restarts
    the learner groups, which restart their rollout services."""
    return HANDLING_RANK.get(kind, 2)


def process_died(ref: Any) -> bool:
    """Whether an ended `run` call ended because its actor's process died."""
    from ray.exceptions import RayActorError

    return isinstance(_error(ref), RayActorError)


def lost_with(
    mates: Sequence[tuple[str, Any, Any]], ping: Callable[[Any], Any], say: Callable[[str], None]
) -> list[Any]:
    """The `run` refs of the `mates` (name, run ref, actor: the roles still running on the node
    of a role whose process died) that do not answer `ping` (a call on their actor) within
    PING_S, once they too have ended (each waited for at most NODE_LOSS_WAIT_S). `say` gets one
    line on what each mate did: what decides whether a node loss is handled as one event."""
    import ray

    started = time.monotonic()
    pings = [ping(actor) for _, _, actor in mates]
    answered, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_S)
    quiet, seen = [], []
    for (name, ref, _), p in zip(mates, pings):
        if p not in answered:
            seen.append(f"{name} silent for {PING_S:g} s")
        elif (error := _error(p)) is not None:
            seen.append(f"{name} failed: {type(error).__name__}")
        else:
            seen.append(f"{name} answered")
            continue
        quiet.append(ref)
    ended, _ = ray.wait(quiet, num_returns=len(quiet), timeout=NODE_LOSS_WAIT_S) if quiet else ([], [])
    said = "; ".join(seen)
    say(f"node check ({time.monotonic() - started:.1f} s): {said}; {len(ended)} of {len(quiet)} quiet ended")
    return ended


def _error(ref: Any) -> Exception | None:
    """What an ended call raised (None: it returned)."""
    import ray

    try:
        ray.get(ref, timeout=0)
    except Exception as e:  # noqa: BLE001 - the caller asks what kind it was
        return e
    return None
