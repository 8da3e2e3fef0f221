"""Old names kept importable for one release, with a DeprecationWarning when used."""

from __future__ import annotations

import types
import warnings


class _Alias(types.ModuleType):
    """A module registered under an old name: every attribute read warns and comes from the new module."""

    def __init__(self, old: str, new: types.ModuleType):
        super().__init__(old, f"Deprecated alias of {new.__name__}.")
        object.__setattr__(self, "_new", new)

    def __getattr__(self, name: str):
        new = object.__getattribute__(self, "_new")
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        warnings.warn(f"the module {self.__name__} is deprecated and goes away in the next release: import from "
                      f"{new.__name__} instead (the router function itself is blazecore.route_topk)",
                      DeprecationWarning, stacklevel=2)
        return getattr(new, name)

    def __dir__(self):
        return dir(object.__getattribute__(self, "_new"))


def module_alias(old: str, new: types.ModuleType) -> types.ModuleType:
    """A module object for ``sys.modules[old]`` that forwards to ``new``, warning on each use."""
    return _Alias(old, new)
