"""One registry per axis of the design space (docs/design.md section 9).

A `Registry` maps a name to the one object that holds every fact about that point of its axis: the
GPPOConfig fields it reads (its parameters), the TokenBatch fields it needs, what theory needs of it.
Config validation, CLI help, `gppo.theory` and the integrations read these objects; no other module
lists names. `gppo.register_divergence`, `register_estimator` and `register_rule` add entries.

Installed packages extend the space without being imported by hand: an entry point of group
`gppo.plugins` names a module whose import registers its entries; plugins load the first time any
registry is read, in every process (the CLI, sweep workers, verl or TRL workers alike).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from importlib import metadata

PLUGIN_GROUP = "gppo.plugins"
_plugins = "unloaded"  # -> "loading" -> "loaded"


def closest(name, choices) -> str:
    """' (did you mean X?)' for the closest valid name, or '' when nothing is close."""
    match = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def load_plugins() -> None:
    """Import every `gppo.plugins` entry point once; a plugin that fails to import is an error
    naming it (never skipped silently)."""
    global _plugins
    if _plugins != "unloaded":
        return
    _plugins = "loading"  # a plugin may read a registry while it registers
    try:
        for entry_point in metadata.entry_points(group=PLUGIN_GROUP):
            try:
                entry_point.load()
            except Exception as err:
                raise ImportError(
                    f"gppo plugin {entry_point.name!r} (entry point {entry_point.value!r} of group "
                    f"{PLUGIN_GROUP!r}) failed to import: {type(err).__name__}: {err}. Fix or "
                    "uninstall the package that declares it"
                ) from err
    except BaseException:
        _plugins = "unloaded"
        raise
    _plugins = "loaded"


class Registry(Mapping):
    """name -> entry for one axis. Built-in entries cannot be removed or replaced."""

    def __init__(self, axis: str):
        self.axis = axis
        self._entries: dict[str, object] = {}
        self._builtin: set[str] = set()

    def add(self, name: str, entry, *, builtin: bool = False) -> None:
        self.check_new(name)
        self._entries[name] = entry
        if builtin:
            self._builtin.add(name)

    def check_new(self, name) -> None:
        """Refuse a name that is not a clean string or is taken (before any work is done for it)."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"a {self.axis} name must be a non-empty string without surrounding spaces (got {name!r})")
        if name in self._entries:
            kind = "a built-in" if name in self._builtin else "an already registered"
            raise ValueError(
                f"{name!r} is {kind} {self.axis}: register yours under another name, "
                f"or call gppo.{self.axis.upper()}S.remove({name!r}) first"
            )

    def remove(self, name: str) -> None:
        """Unregister a user entry (tests, notebooks re-running a registration)."""
        if name in self._builtin:
            raise ValueError(f"{name!r} is a built-in {self.axis} and cannot be removed")
        if name not in self._entries:
            raise KeyError(f"no registered {self.axis} {name!r}")
        del self._entries[name]

    def lookup(self, name):
        """The entry called `name`, or a ValueError naming the closest valid name and every choice."""
        load_plugins()
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        raise ValueError(
            f"unknown {self.axis} {name!r}{closest(name, self._entries)}; choose one of {list(self._entries)}"
        )

    def __getitem__(self, name):
        load_plugins()
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        load_plugins()
        return iter(list(self._entries))

    def __len__(self) -> int:
        load_plugins()
        return len(self._entries)

    def __contains__(self, name) -> bool:
        load_plugins()
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.axis!r}: {', '.join(self._entries)})"
