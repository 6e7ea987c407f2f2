"""Who holds a lease: a consumer's stable name and the id of its current start.

A learner names itself on every GET so that, when it starts anew (a resume after a crash), the
shards requeue what its earlier life still held at once instead of after `lease_timeout_s`
(docs/protocol.md, GET; docs/architecture.md, Buffer).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Holder:
    name: str = ""  # "learner/<policy>"; "": anonymous, its leases are never taken over
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)  # new at every start

    @classmethod
    def anonymous(cls) -> Holder:
        return cls("", "")
