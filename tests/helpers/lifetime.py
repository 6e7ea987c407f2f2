"""Factory fixtures that close everything they made, also when the test failed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> Any: ...


C = TypeVar("C", bound=Closable)


@contextmanager
def closing_all(make: Callable[..., C]) -> Iterator[Callable[..., C]]:
    """`make`, remembering what it returns; on leaving the block every object made is closed,
    in the order made. A fixture yields from inside the block: its teardown closes them."""
    made: list[C] = []

    def tracked(*args: Any, **kwargs: Any) -> C:
        made.append(make(*args, **kwargs))
        return made[-1]

    try:
        yield tracked
    finally:
        for thing in made:
            thing.close()
