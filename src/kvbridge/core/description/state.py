"""State-type resolution: which handler serves a pool object, by class hierarchy.

A pool is served by the handler registered for the most specific class in its
method-resolution order, so a pool class derived from a registered one (a
DeepSeek-V4 pool deriving from the SWA pool) is handled without registering
anything, and registering a new pool type touches no dispatcher code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from .records import StateHandlerSpec

__all__ = ["StateResolver", "UnknownPoolTypeError", "class_key"]

T = TypeVar("T")


class UnknownPoolTypeError(LookupError):
    """No state handler serves this pool's class or any of its bases."""


def class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class StateResolver(Generic[T]):
    """Maps pool classes (objects or ``"module:QualName"`` strings) to values."""

    def __init__(self, entries: Iterable[tuple[type | str, T]] = ()) -> None:
        self._by_key: dict[str, T] = {}
        for pool_type, value in entries:
            self.add(pool_type, value)

    def add(self, pool_type: type | str, value: T) -> None:
        key = pool_type if isinstance(pool_type, str) else class_key(pool_type)
        if key in self._by_key and self._by_key[key] is not value:
            raise ValueError(f"pool type {key} is registered twice")
        self._by_key[key] = value

    def resolve(self, pool: object) -> T:
        for cls in type(pool).__mro__:
            value = self._by_key.get(class_key(cls))
            if value is not None:
                return value
        known = ", ".join(sorted(self._by_key)) or "none"
        raise UnknownPoolTypeError(
            f"no state handler serves pool type {class_key(type(pool))} or any of its "
            f"base classes (registered pool types: {known}); register a state handler "
            "for it or derive the pool from a registered pool class"
        )

    @classmethod
    def from_specs(cls, specs: Iterable[StateHandlerSpec]) -> StateResolver[StateHandlerSpec]:
        resolver: StateResolver[StateHandlerSpec] = StateResolver()
        for spec in specs:
            for pool_type in spec.pool_types:
                resolver.add(pool_type, spec)
        return resolver
