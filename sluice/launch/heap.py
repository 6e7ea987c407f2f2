"""Keep CPython's full garbage collections off a role's steady state.

A role builds once (imports, model, sockets) and then loops, allocating short-lived objects.
CPython's generation-2 pass walks every tracked object, and after torch and transformers are
imported a learner or an LLM rollout service holds ~400,000 of them: one pass took 0.06-0.41 s
on the 2-core VM, inside a learner step or a rollout's PUT (which then starved the learner for
as long). `freeze_startup_heap` is called once a role is built, beside its placement: one full
collection, then `gc.freeze()` moves what survived to the permanent generation, so later passes
walk only objects made since. Reference counting still frees frozen objects; only a cycle among
them that becomes garbage later is never collected (start-up state is kept for the whole run).
Measured: docs/architecture.md, "Cores and threads".
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object the process holds now; returns how many are frozen.
    Calling it again (several services packed in one process) freezes what was made since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
