"""A lazy name -> class table, shared by the tool-call and reasoning parser families: a class's module is
imported only when its name is asked for, so listing names costs nothing."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """`table` maps a public name to (module, class name); every class must subclass `base`."""

    def __init__(self, kind: str, base: type[T], table: dict[str, tuple[str, str]]) -> None:
        self.kind, self.base, self.table = kind, base, table  # the table is shared: entries may be added later

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self.table)

    def get(self, name: str) -> type[T]:
        """The class registered under `name`; ValueError naming the registered ones if there is none."""
        if name not in self.table:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        module_name, class_name = self.table[name]
        cls = getattr(importlib.import_module(module_name), class_name)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{module_name}.{class_name} is not a {self.base.__name__}")
        return cls
