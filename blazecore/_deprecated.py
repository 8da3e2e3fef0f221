"""Old module names kept importable for one release: importing one warns (DeprecationWarning) and gives the module
that replaced it.

The old names are found by a finder on ``sys.meta_path`` only when imported, so nothing about them sits in
``sys.modules`` (where tools that scan every module, such as pickle's lookup of a function's module, would trip
over them). ``blazecore.route_topk`` was a module and is now the router function: the package keeps the function
as that attribute when the old module name is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old module name -> the module that replaced it
RENAMED = {
    "blazecore.route_topk": "blazecore.router",
    "blazecore.reference.route_topk": "blazecore.reference.router",
}


class _Loader(importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        warnings.warn(f"the module {self.old} is deprecated and goes away in the next release: import from "
                      f"{self.new} instead (the router function itself is blazecore.route_topk)",
                      DeprecationWarning, stacklevel=2)  # warnings skips importlib's frames: the import
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        # the new module is already executed; the import system gave it the old name's spec: give its own back
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = RENAMED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(fullname, new))


class _Package(types.ModuleType):
    """The ``blazecore`` package's type: an import of the old module ``blazecore.route_topk`` sets the package's
    attribute to that module; the attribute stays the router function instead."""

    def __setattr__(self, name, value):
        if name == "route_topk" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
    """Register the finder of the old names (once) and give ``package`` the type that keeps its function."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    package.__class__ = _Package
