"""Keep a role's steady state free of work left over from its start: the garbage collector's
full passes over start-up objects, and malloc handing freed memory back to the kernel.

A role builds once (imports, model, sockets) and then loops, allocating short-lived objects.
CPython's generation-2 pass walks every tracked object, and after torch and transformers are
imported a learner or an LLM rollout service holds ~400,000 of them: one pass took 0.06-0.41 s
on the 2-core VM, inside a learner step or a rollout's PUT (which then starved the learner for
as long). `freeze_startup_heap` is called once a role is built, beside its placement: one full
collection, then `gc.freeze()` moves what survived to the permanent generation, so later passes
walk only objects made since. Reference counting still frees frozen objects; only a cycle among
them that becomes garbage later is never collected (start-up state is kept for the whole run).

`retain_freed_memory`, called beside it, is the same kind of fix one level down: with glibc's
defaults a training step that frees its activations hands the top of the heap back to the
kernel and faults those pages in again at the next step.
Both measured: docs/architecture.md, "Cores and threads".
"""

from __future__ import annotations

import ctypes
import gc

# mallopt(3) parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
TRIM_THRESHOLD = 256 * 2**20  # free heap a process keeps before handing its top back
TOP_PAD = 64 * 2**20  # extra heap asked for at each growth, so a step's peak needs no new sbrk
MMAP_THRESHOLD = 32 * 2**20  # blocks served by mmap (glibc's largest allowed on 64-bit)


def freeze_startup_heap() -> int:
    """Collect, then freeze every object the process holds now; returns how many are frozen.
    Calling it again (several services packed in one process) freezes what was made since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def retain_freed_memory() -> bool:
    """Make glibc's malloc keep what a role frees for its next step instead of returning it to
    the kernel (mallopt: trim threshold, top pad, mmap threshold). Called once a role is built,
    beside `freeze_startup_heap`; False where the C library is not glibc (nothing changed).
    Costs a process up to TRIM_THRESHOLD of resident memory that it would otherwise give back."""
    libc = ctypes.CDLL(None)  # the process's own symbols: the C library it runs on
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD),
    )
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
