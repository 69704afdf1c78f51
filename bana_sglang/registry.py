"""A registry of pluggable classes by name (routing policies, balancers).

``Registry`` is a read-only mapping from name to class; :meth:`Registry.create`
builds a fresh instance, and an unknown name raises the registry's error with
the list of valid names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, type[T]], Generic[T]):
    """Classes by their ``name`` attribute. ``what`` names the kind in errors
    ("routing policy"); ``error`` is the exception type raised for an unknown name
    (called with the message, plus ``error_kwargs(name)`` as keyword arguments)."""

    def __init__(
        self,
        what: str,
        classes: Iterable[type[T]],
        *,
        error: type[Exception] = KeyError,
        error_kwargs: Any = None,
    ):
        self.what = what
        self._classes: dict[str, type[T]] = {}
        for cls in classes:
            name = cls.name  # type: ignore[attr-defined]
            if name in self._classes:
                raise ValueError(f"two {what} classes are named {name!r}")
            self._classes[name] = cls
        self._error = error
        self._error_kwargs = error_kwargs or (lambda name: {})

    def __getitem__(self, name: str) -> type[T]:
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def create(self, name: str, **kwargs: Any) -> T:
        """A fresh instance of the class registered as ``name``."""
        try:
            cls = self._classes[name]
        except KeyError:
            raise self._error(
                f"unknown {self.what} {name!r}; valid: {', '.join(sorted(self._classes))}",
                **self._error_kwargs(name),
            ) from None
        return cls(**kwargs)
