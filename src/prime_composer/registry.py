"""One registry shape for every plugin point: entries registered by name when their module is
imported, and modules imported lazily on first use (so a backend's heavy dependencies load only
when it is chosen).

    BACKENDS: Registry[InferenceBackend] = Registry("inference.backend", {"hf": "pkg.hf.backend"})
    BACKENDS.register("hf", backend)        # at import time of pkg.hf.backend
    BACKENDS.get("hf")                      # imports pkg.hf.backend first if nothing is registered

A ``Registry`` is a read-only mapping of what is registered so far. ``load_all`` imports every
known module (and the entry points of ``entry_point_group``) for registries that are iterated
whole, like the channels. Standard library only, importing nothing of the project.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Entries by name; ``modules`` says which module registers each known name."""

    def __init__(
        self, what: str, modules: Mapping[str, str], *, entry_point_group: str | None = None
    ) -> None:
        self.what = what
        """The config key or kind the names are values of, for error messages."""
        self.modules = dict(modules)
        self.entry_point_group = entry_point_group
        self._entries: dict[str, T] = {}
        self._loaded = False

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under a new ``name`` (a name registered twice is a ValueError)."""
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def get_or_load(self, name: str) -> T:
        """The entry ``name``, importing its module first if it is not registered yet."""
        if name not in self._entries:
            if name not in self.modules:
                raise ValueError(f"{self.what} = {name!r}: choose one of {sorted(self.modules)}")
            importlib.import_module(self.modules[name])
            if name not in self._entries:
                raise ValueError(
                    f"{self.what} {name!r}: {self.modules[name]} registered nothing under that name"
                )
        return self._entries[name]

    def load_all(self) -> None:
        """Import every known module and entry point once (re-entrant: a module importing while
        this runs sees the registry as loaded)."""
        if self._loaded:
            return
        self._loaded = True
        for module in self.modules.values():
            importlib.import_module(module)
        if self.entry_point_group is not None:
            for entry in entry_points(group=self.entry_point_group):
                entry.load()

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
